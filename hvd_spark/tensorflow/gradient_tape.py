"""``DistributedGradientTape``: a GradientTape whose gradients are averaged across ranks."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.errors import ConfigError
from hvd_spark.tensorflow.compression import Compression, Compressor
from hvd_spark.tensorflow.gradients import allreduce_gradients, check_reduce_args


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients reduced over ranks.

    Everything else (``watch``, ``stop_recording``, ...) is the wrapped tape's. Works
    eagerly and inside ``tf.function``.

    Args:
        gradtape: The tape that recorded the forward pass.
        device_dense, device_sparse: Accepted for Horovod compatibility; ignored.
        compression: ``Compression.none`` or ``Compression.fp16``.
        sparse_as_dense: Accepted for compatibility: sparse gradients are always densified.
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: Divide by this before summing and by
            ``size / factor`` after (Average only).
    """

    def __init__(
        self, gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
        compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
        op: ReduceOp = ReduceOp.Average, gradient_predivide_factor: float = 1.0,
    ) -> None:
        del device_dense, device_sparse, sparse_as_dense
        if not isinstance(gradtape, tf.GradientTape):
            raise ConfigError(
                f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
        self._tape = gradtape
        self._compression = compression
        self._op = check_reduce_args(op, gradient_predivide_factor, "DistributedGradientTape")
        self._predivide = float(gradient_predivide_factor)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        """The wrapped tape's gradients, reduced across ranks (same structure as sources)."""
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        reduced = allreduce_gradients(flat, "DistributedGradientTape.grads",
                                      self._compression, self._op, self._predivide)
        return tf.nest.pack_sequence_as(grads, reduced)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tape.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)
