"""TensorFlow's CPU kernels for large float16 reductions, lent to the collectives.

numpy adds float16 arrays element by element (about 7-9 ns an element here), so a
TensorFlow job's float16 allreduce (``Compression.fp16``, mixed precision) reduced at a
fifth of float32's speed. TensorFlow's element-wise kernels convert to float32, compute
and round to nearest even once, vectorised, which is what ``hvd_spark.collectives.ops``
computes too: results stay bitwise the same. bfloat16 stays with numpy, whose path
through float32 scratch was faster here than TensorFlow's kernels.

Each call costs about 85 us of eager dispatch, so small arrays decline and numpy does
them. So does a call where TensorFlow could misbehave:
- not executing eagerly (TF1 graph mode would build nodes instead);
- asynchronous eager execution (the op would queue behind the running ``tf.function``
  whose ``numpy_function`` callback is this very reduction: a deadlock);
- before TensorFlow's runtime has started (the first op would start it: fixing its thread
  pools and, with a GPU build, its devices before the user configured them);
- a float32-subnormal scale factor (TensorFlow flushes it to zero).
Large arrays go in slices of ``SLICE`` elements: TensorFlow copies its inputs, and a whole
256 MB tensor at once would hold several copies.

The binding's ``init()`` registers these kernels once (:func:`register_once`), unless
others are registered already (torch's, when both bindings are in use, are faster);
importing registers nothing.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from hvd_spark.collectives import ops

try:  # private: whether TensorFlow's runtime has started (see ``_runtime_started``)
    from tensorflow.python.eager import context as _context
except ImportError:  # pragma: no cover - other TensorFlow versions
    _context = None

#: Below this many elements numpy is faster than one eager TensorFlow call (reductions
#: broke even near 10K elements here, scaling near 28K: three calls).
MIN_ELEMENTS = 16 * 1024
MIN_SCALE_ELEMENTS = 32 * 1024
#: Elements per TensorFlow call: bounded temporary copies, dispatch still under 10%.
SLICE = 1 << 20

_OPS = {
    ops.ReduceOp.Sum: tf.math.add,
    ops.ReduceOp.Average: tf.math.add,  # the caller divides afterwards
    ops.ReduceOp.Min: tf.math.minimum,
    ops.ReduceOp.Max: tf.math.maximum,
    ops.ReduceOp.Product: tf.math.multiply,
}
_FLOAT16 = np.dtype(np.float16)
_TINY = np.finfo(np.float32).tiny  # smaller nonzero factors are subnormal


def _runtime_started() -> bool:
    try:  # private, and cheap (0.1 us): whether an op or a device query started it
        return bool(_context.context()._initialized)
    except AttributeError:  # pragma: no cover - other TensorFlow versions
        return False


def _synchronous() -> bool:
    """Whether this thread's eager ops run synchronously.

    Read from the context's fields, not through ``get_synchronous_execution``: that wraps
    the thread's executor in a temporary object whose deletion waits for every pending op,
    which inside an asynchronous ``tf.function``'s callback (this reduction) never ends.
    """
    try:
        ctx = _context.context()
        if ctx._default_is_async:  # set before the runtime started: every thread
            return False
        local = ctx._thread_local_data.executor  # set on this thread after the start
    except AttributeError:  # pragma: no cover - other TensorFlow versions
        return False
    return local is None or not local.is_async()


def _takes(arr: np.ndarray, min_elements: int) -> bool:
    return (arr.dtype == _FLOAT16 and arr.size >= min_elements and _runtime_started()
            and _synchronous() and tf.executing_eagerly())


def reduce(dst: np.ndarray, src: np.ndarray, op: ops.ReduceOp, base: np.ndarray) -> bool:
    """``dst = op(base, src)`` with TensorFlow; False (numpy does it) where it declines."""
    fn = _OPS.get(op)
    if fn is None or not _takes(dst, MIN_ELEMENTS):
        return False
    # On the CPU even where a GPU is visible (eager ops go to GPU:0 by default there).
    # ``base`` is read into TensorFlow's input before ``dst`` (maybe ``base``) is written.
    with tf.device("/cpu:0"):
        for start in range(0, dst.size, SLICE):
            part = slice(start, start + SLICE)
            np.copyto(dst[part], fn(base[part], src[part]).numpy())
    return True


def scale(arr: np.ndarray, factor: float) -> bool:
    """``arr *= float32(factor)``: computed in float32, rounded once (as numpy does)."""
    f32 = np.float32(factor)
    if not _takes(arr, MIN_SCALE_ELEMENTS) or 0 < abs(f32) < _TINY:
        return False
    with tf.device("/cpu:0"):
        for start in range(0, arr.size, SLICE):
            part = arr[start:start + SLICE]
            np.copyto(part, tf.cast(tf.cast(part, tf.float32) * f32, tf.float16).numpy())
    return True


KERNELS = ops.HalfKernels(name="tensorflow", reduce=reduce, scale=scale)

# register(): TensorFlow's from now on unless another binding's (torch's, faster) are
# registered; register_once(): on hvd_spark.tensorflow's first init(); unregister().
_REGISTRATION = ops.HalfKernelRegistration(KERNELS, replace=False)
register, register_once, unregister = (_REGISTRATION.register, _REGISTRATION.register_once,
                                       _REGISTRATION.unregister)
