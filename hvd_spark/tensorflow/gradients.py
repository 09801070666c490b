"""Averaging a list of gradients across ranks: the step shared by the tape and optimizer."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from hvd_spark import collectives as C
from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.errors import ConfigError
from hvd_spark.tensorflow.compression import Compressor
from hvd_spark.tensorflow.ops import grouped_allreduce


def check_reduce_args(op: ReduceOp, predivide: float, where: str) -> ReduceOp:
    """Validate the gradient reduction ``op`` and ``gradient_predivide_factor``."""
    try:
        op = ReduceOp(op)
    except ValueError as exc:
        raise ConfigError(f"{where}: op={op!r} is not a ReduceOp; use Average or Sum") from exc
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ConfigError(f"{where}: gradients reduce with Average or Sum, got op={op.name}")
    if predivide != 1.0 and op != ReduceOp.Average:
        raise ConfigError(f"{where}: gradient_predivide_factor needs op=Average")
    if predivide <= 0:
        raise ConfigError(f"{where}: gradient_predivide_factor must be > 0, got {predivide}")
    return op


def allreduce_gradients(
    grads: Sequence[tf.Tensor | tf.IndexedSlices | None], name: str,
    compression: type[Compressor], op: ReduceOp, predivide: float = 1.0,
) -> list[tf.Tensor | None]:
    """Reduce the non-None gradients in one fused collective; Nones pass through.

    IndexedSlices (embeddings) are made dense first: one fused dense buffer beats an
    allgather per sparse gradient for the model sizes this library targets.
    """
    if C.size() == 1:
        return list(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    dense = [tf.convert_to_tensor(grads[i]) for i in present]
    reduced = grouped_allreduce(
        dense, compression=compression, op=op, prescale_factor=1.0 / predivide,
        postscale_factor=predivide, name=name)
    out: list[tf.Tensor | None] = list(grads)
    for i, r in zip(present, reduced):
        out[i] = r
    return out
