"""``DistributedGradientTape`` and ``PartialDistributedGradientTape`` (Horovod's names)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.collectives.process_sets import ProcessSet, global_process_set
from hvd_spark.errors import ConfigError
from hvd_spark.tensorflow.compression import Compression, Compressor
from hvd_spark.tensorflow.gradients import GradientReducer, make_groups


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients reduced over ranks.

    Everything else (``watch``, ``stop_recording``, ...) is the wrapped tape's. Works
    eagerly and inside ``tf.function``.

    Args:
        gradtape: The tape that recorded the forward pass.
        device_dense: Accepted for Horovod compatibility; ignored.
        device_sparse: Accepted for Horovod compatibility; ignored.
        compression: ``Compression.none`` or ``Compression.fp16``.
        sparse_as_dense: Densify ``tf.IndexedSlices`` gradients (else they are allgathered).
        op: ``Average`` (default), ``Sum`` or ``Adasum``.
        gradient_predivide_factor: Divide by this before summing and by
            ``size / factor`` after (Average only).
        num_groups: Deprecated: split the gradients into this many fused operations.
        groups: An int (as ``num_groups``) or lists of variables fused together.
        process_set: The ranks that average their gradients.
        scale_local_gradients: Divide the gradients of local sources by the set's size.
    """

    def __init__(
        self, gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
        compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
        op: ReduceOp = ReduceOp.Average, gradient_predivide_factor: float = 1.0,
        num_groups: int = 0, groups: Any = None,
        process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True,
    ) -> None:
        del device_dense, device_sparse
        if not isinstance(gradtape, tf.GradientTape):
            raise ConfigError(
                f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
        self._tape = gradtape
        self._reducer = GradientReducer(
            "DistributedGradientTape", compression, op, float(gradient_predivide_factor),
            bool(sparse_as_dense), make_groups(num_groups, groups, "DistributedGradientTape"),
            process_set, bool(scale_local_gradients))

    @property
    def process_set(self) -> ProcessSet:
        """The ranks that average their gradients."""
        return self._reducer.process_set

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient on this rank (no allreduce), e.g. model-parallel layers."""
        self._reducer.register_local_source(source)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
                 use_generic_names: bool = False) -> Any:
        """The wrapped tape's gradients, reduced across ranks (same structure as sources)."""
        del use_generic_names
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources, expand_composites=False)
        flat = tf.nest.flatten(grads, expand_composites=False)
        reduced = self._reducer.reduce(flat, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(
        self, target: Any, sources: Sequence[Any], output_gradients: Any = None,
        use_generic_names: bool = False,
    ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """``(local, global)`` lists of ``(source, gradient)`` pairs, in source order."""
        grads = self.gradient(target, sources, output_gradients,
                              use_generic_names=use_generic_names)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if self._reducer.is_local(s) else shared).append((s, g))
        return local, shared

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tape.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)


def PartialDistributedGradientTape(  # noqa: N802 - Horovod's public name
    gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
    compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
    op: ReduceOp = ReduceOp.Average, gradient_predivide_factor: float = 1.0,
    num_groups: int = 0, groups: Any = None, process_set: ProcessSet = global_process_set,
    local_layers: Any = None, scale_local_gradients: bool = True,
) -> DistributedGradientTape:
    """A ``DistributedGradientTape`` whose ``local_layers``' weights keep local gradients.

    The other arguments are ``DistributedGradientTape``'s.

    Args:
        local_layers: A Keras layer or a list of them (model-parallel parts); their
            trainable weights are registered as local sources.
    """
    tape = DistributedGradientTape(
        gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
        gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    for layer in local_layers:
        if not hasattr(layer, "trainable_weights"):
            raise ConfigError(
                f"PartialDistributedGradientTape: local_layers must be Keras layers, got "
                f"{type(layer).__name__}")
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
