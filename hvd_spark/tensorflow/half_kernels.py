"""TensorFlow's CPU kernels for large float16 reductions, lent to the collectives.

numpy adds float16 arrays element by element (about 7-9 ns an element here), so a
TensorFlow job's float16 allreduce (``Compression.fp16``, mixed precision) reduced at a
fifth of float32's speed. TensorFlow's element-wise kernels convert to float32, compute
and round to nearest even once, vectorised, which is what ``hvd_spark.collectives.ops``
computes too: results stay bitwise the same. bfloat16 stays with numpy, whose path
through float32 scratch was faster here than TensorFlow's kernels.

Each call costs about 85 us of eager dispatch, so arrays under ``MIN_ELEMENTS`` decline
and numpy does them; so does a call where TensorFlow is not executing eagerly (a TF1
session's callback would build graph nodes instead). Importing ``hvd_spark.tensorflow``
registers these kernels unless others are registered already (torch's, when both
bindings are loaded, are faster).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from hvd_spark.collectives import ops

#: Below this many elements numpy is faster than one eager TensorFlow call.
MIN_ELEMENTS = 16 * 1024

_OPS = {
    ops.ReduceOp.Sum: tf.math.add,
    ops.ReduceOp.Average: tf.math.add,  # the caller divides afterwards
    ops.ReduceOp.Min: tf.math.minimum,
    ops.ReduceOp.Max: tf.math.maximum,
    ops.ReduceOp.Product: tf.math.multiply,
}


_FLOAT16 = np.dtype(np.float16)


def _takes(arr: np.ndarray) -> bool:
    return (arr.dtype == _FLOAT16 and arr.size >= MIN_ELEMENTS
            and tf.executing_eagerly())


def reduce(dst: np.ndarray, src: np.ndarray, op: ops.ReduceOp, base: np.ndarray) -> bool:
    """``dst = op(base, src)`` with TensorFlow; False (numpy does it) where it declines."""
    fn = _OPS.get(op)
    if fn is None or not _takes(dst):
        return False
    # On the CPU even where a GPU is visible (eager ops go to GPU:0 by default there).
    # ``base`` is read into TensorFlow's input before ``dst`` (maybe ``base``) is written.
    with tf.device("/cpu:0"):
        np.copyto(dst, fn(base, src).numpy())
    return True


def scale(arr: np.ndarray, factor: float) -> bool:
    """``arr *= float32(factor)``: computed in float32, rounded once (as numpy does)."""
    if not _takes(arr):
        return False
    with tf.device("/cpu:0"):
        wide = tf.cast(arr, tf.float32) * np.float32(factor)
        np.copyto(arr, tf.cast(wide, tf.float16).numpy())
    return True


KERNELS = ops.HalfKernels(name="tensorflow", reduce=reduce, scale=scale)


def register() -> None:
    """Reduce and scale large float16/bfloat16 arrays with TensorFlow from now on, unless
    another binding's kernels are registered already."""
    if ops.half_kernels_name() == "numpy":
        ops.register_half_kernels(KERNELS)


def unregister() -> None:
    """Go back to the numpy kernels if TensorFlow's are the registered ones."""
    if ops.half_kernels_name() == KERNELS.name:
        ops.register_half_kernels(None)
