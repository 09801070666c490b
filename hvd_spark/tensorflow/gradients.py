"""Reducing a list of gradients across ranks: the step shared by the tape and optimizers.

Horovod's options: ``op`` (Average, Sum, Adasum), ``gradient_predivide_factor``,
``sparse_as_dense`` (else ``tf.IndexedSlices`` are allgathered), ``num_groups``/``groups``
(how gradients are split into fused operations), ``process_set``, and local sources whose
gradients stay on their rank (scaled by 1/size when ``scale_local_gradients``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hvd_spark.collectives.elastic import is_elastic
from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.collectives.process_sets import ProcessSet, global_process_set
from hvd_spark.errors import ConfigError
from hvd_spark.tensorflow import kernel
from hvd_spark.tensorflow.compression import Compression, Compressor
from hvd_spark.tensorflow.ops import grouped_allreduce


def check_reduce_args(op: Any, predivide: float, where: str) -> ReduceOp:
    """Validate the gradient reduction ``op`` and ``gradient_predivide_factor``."""
    try:
        op = ReduceOp(op)
    except ValueError as exc:
        raise ConfigError(f"{where}: op={op!r} is not a ReduceOp; use Average, Sum or "
                          "Adasum") from exc
    if op not in (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum):
        raise ConfigError(f"{where}: gradients reduce with Average, Sum or Adasum, got "
                          f"op={op.name}")
    if predivide != 1.0 and op != ReduceOp.Average:
        raise ConfigError(f"{where}: gradient_predivide_factor needs op=Average")
    if predivide <= 0:
        raise ConfigError(f"{where}: gradient_predivide_factor must be > 0, got {predivide}")
    return op


@dataclasses.dataclass
class GradientReducer:
    """How one tape or optimizer reduces its gradients (Horovod's constructor arguments).

    Attributes:
        name: Base name of the collectives (the same on every rank).
        compression: How dense gradients travel.
        op: Average, Sum or Adasum.
        predivide: ``gradient_predivide_factor``.
        sparse_as_dense: Densify ``tf.IndexedSlices`` (else they are allgathered).
        groups: None (one fused operation), an int (that many), or lists of variables
            (each list fused together; other gradients fused as one more group).
        process_set: The ranks that average their gradients.
        scale_local_gradients: Divide local sources' gradients by the set's size.
    """

    name: str
    compression: type[Compressor] = Compression.none
    op: ReduceOp = ReduceOp.Average
    predivide: float = 1.0
    sparse_as_dense: bool = False
    groups: Any = None
    process_set: ProcessSet = global_process_set
    scale_local_gradients: bool = True
    local_sources: set = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        self.op = check_reduce_args(self.op, self.predivide, self.name)
        if isinstance(self.groups, bool) or (self.groups is not None and not isinstance(
                self.groups, (int, list, tuple))):
            raise ConfigError(f"{self.name}: groups must be an int or a list of lists of "
                              f"variables, got {self.groups!r}")
        if isinstance(self.groups, int) and self.groups < 0:
            raise ConfigError(f"{self.name}: num_groups must be >= 0, got {self.groups}")
        if not isinstance(self.process_set, ProcessSet):
            raise ConfigError(f"{self.name}: process_set must be a ProcessSet, got "
                              f"{self.process_set!r}")

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient on this rank (model-parallel parts of a model)."""
        self.local_sources.add(_ref(source))

    def is_local(self, source: Any) -> bool:
        """True if ``source`` was registered as local."""
        return source is not None and _ref(source) in self.local_sources

    def reduce(self, grads: Sequence[Any], sources: Sequence[Any] | None = None) -> list[Any]:
        """Reduce the gradients of non-local sources; Nones pass through; same order."""
        grads = list(grads)
        sources = list(sources) if sources is not None else [None] * len(grads)
        n = kernel.members_size(self.process_set)
        # An elastic ring may grow after this trace: keep its collectives even at size 1.
        elastic = is_elastic()
        out: list[Any] = list(grads)
        todo = []
        for i, (g, s) in enumerate(zip(grads, sources)):
            if g is None:
                continue
            if self.is_local(s):
                if self.scale_local_gradients and (n > 1 or elastic):
                    out[i] = _divide(g, kernel.size_tensor(self.process_set))
                continue
            if self.sparse_as_dense and isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
                out[i] = g
            todo.append(i)
        outside = (self.process_set is not global_process_set
                   and self.process_set.included() is False)
        if (n == 1 and not elastic) or outside or not todo:
            return out  # as Horovod: nothing to average with
        for k, group in enumerate(self._split(todo, sources)):
            reduced = grouped_allreduce(
                [out[i] for i in group], compression=self.compression, op=self.op,
                prescale_factor=1.0 / self.predivide, postscale_factor=self.predivide,
                process_set=self.process_set, name=f"{self.name}.{k}")
            for i, r in zip(group, reduced):
                out[i] = r
        return out

    def _split(self, todo: list[int], sources: list[Any]) -> list[list[int]]:
        if not todo:
            return []
        if self.groups is None or self.groups == 0:
            return [todo]
        if isinstance(self.groups, int):
            k = min(self.groups, len(todo))
            size, extra = divmod(len(todo), k)
            out, start = [], 0
            for j in range(k):
                end = start + size + (1 if j < extra else 0)
                out.append(todo[start:end])
                start = end
            return out
        where = {}
        for j, group in enumerate(self.groups):
            for var in group:
                where[_ref(var)] = j
        grouped: dict[int, list[int]] = {}
        for i in todo:
            grouped.setdefault(where.get(_ref(sources[i]), len(self.groups)), []).append(i)
        return [grouped[j] for j in sorted(grouped)]


def _ref(source: Any) -> Any:
    return source.ref() if hasattr(source, "ref") else id(source)


def _divide(grad: Any, size: int | tf.Tensor) -> Any:
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / tf.cast(size, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad / tf.cast(size, grad.dtype)


def make_groups(num_groups: int, groups: Any, where: str) -> Any:
    """Horovod's ``num_groups`` (deprecated) and ``groups`` as one setting."""
    if num_groups and groups is not None:
        raise ConfigError(f"{where}: pass num_groups or groups, not both")
    return groups if groups is not None else (num_groups or None)
