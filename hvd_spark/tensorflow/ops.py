"""Reductions on ``tf.Tensor``/``tf.Variable``/``tf.IndexedSlices``, eager and in graphs.

``allreduce``, ``grouped_allreduce``, ``reducescatter`` and ``grouped_reducescatter``
with Horovod's signatures and gradients. Each runs the framework-free numpy collectives
through ``kernel.run`` (at once when eager, as a deadlock-free graph node otherwise).
``tf.IndexedSlices`` are allgathered (values and indices), as Horovod does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hvd_spark import collectives as C
from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.collectives.process_sets import ProcessSet, global_process_set
from hvd_spark.errors import ConfigError
from hvd_spark.tensorflow import kernel
from hvd_spark.tensorflow.compression import Compression, Compressor
from hvd_spark.tensorflow.gather_ops import grouped_allgather

_DIFFERENTIABLE = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum)


def resolve_op(op: Any, average: bool | None) -> ReduceOp:
    """Horovod's ``op``/deprecated ``average`` pair as one ReduceOp (Average by default)."""
    if op is not None and average is not None:
        raise ConfigError("allreduce: pass either op= or the deprecated average=, not both")
    if op is None:
        return ReduceOp.Sum if average is False else ReduceOp.Average
    try:
        return ReduceOp(op)
    except ValueError as exc:
        raise ConfigError(f"op={op!r} is not a ReduceOp (Average, Sum, Adasum, Min, Max, "
                          "Product)") from exc


def _raw_grouped_allreduce(tensors: list[tf.Tensor], op: ReduceOp, prescale: float,
                           postscale: float, name: str | None, process_set: ProcessSet,
                           single: bool = False) -> list[tf.Tensor]:
    """``single``: ``allreduce``'s one tensor, a plain allreduce (a group of one would
    travel packed: a copy in and out, and a layout). A ``grouped_allreduce`` of one stays
    a group, so a rank whose group has another length fails at once with the layout error."""
    base = kernel.graph_name("allreduce" if single else "grouped_allreduce", name)

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        if single:
            return [C.allreduce(arrays[0], base, op, prescale, postscale,
                                process_set=process_set)]
        return C.grouped_allreduce(list(arrays), base, op, prescale, postscale,
                                   process_set=process_set)

    outs = kernel.run(fn, tensors, [t.dtype for t in tensors])
    if not tf.executing_eagerly():  # eager results have their shapes already
        for o, t in zip(outs, tensors):
            o.set_shape(t.shape)
    return outs


def _dense_group(tensors: list[tf.Tensor], op: ReduceOp, prescale: float, postscale: float,
                 name: str | None, process_set: ProcessSet,
                 single: bool = False) -> list[tf.Tensor]:
    """Reduce dense tensors in one fused operation; differentiable for Sum/Average/Adasum."""
    if not (op in _DIFFERENTIABLE and kernel.needs_gradient()
            and all(t.dtype.is_floating for t in tensors)):
        return _raw_grouped_allreduce(tensors, op, prescale, postscale, name, process_set,
                                      single)

    @tf.custom_gradient
    def with_grad(*xs):
        ys = _raw_grouped_allreduce(list(xs), op, prescale, postscale, name, process_set,
                                    single)

        def grad(*dys):
            gname = None if name is None else f"{name}.grad"
            return _raw_grouped_allreduce([tf.convert_to_tensor(d) for d in dys], op,
                                          prescale, postscale, gname, process_set, single)

        return ys, grad

    return list(with_grad(*tensors))


def _check_sparse(op: ReduceOp, prescale: float, postscale: float, name: str | None,
                  process_set: ProcessSet) -> None:
    """Horovod's limits for IndexedSlices (NotImplementedError), reported to the others."""
    problem = None
    if op == ReduceOp.Adasum:
        problem = ("Adasum does not reduce tf.IndexedSlices; pass sparse_as_dense=True to the "
                   "DistributedOptimizer/DistributedGradientTape")
    elif op not in (ReduceOp.Sum, ReduceOp.Average):
        problem = f"tf.IndexedSlices reduce with Sum or Average only, got op={op.name}"
    elif prescale != 1.0 or postscale != 1.0:
        problem = "prescale/postscale factors do not apply to tf.IndexedSlices"
    if problem is not None:
        names = [] if name is None else [f"{name}.values", f"{name}.indices"]
        raise kernel.fail_locally("allgather", names, process_set,
                                  NotImplementedError(problem))


def _sparse_group(slices: list[tf.IndexedSlices], op: ReduceOp, name: str | None,
                  process_set: ProcessSet) -> list[tf.IndexedSlices]:
    """Allgather values and indices: the reduced tensor is what the gathered slices add to."""
    values = grouped_allgather([s.values for s in slices],
                               name=None if name is None else f"{name}.values",
                               process_set=process_set)
    indices = grouped_allgather([s.indices for s in slices],
                                name=None if name is None else f"{name}.indices",
                                process_set=process_set)
    n = kernel.size_tensor(process_set)
    out = []
    for s, v, i in zip(slices, values, indices):
        if op == ReduceOp.Average:
            v = v / tf.cast(n, v.dtype)
        out.append(tf.IndexedSlices(v, i, dense_shape=s.dense_shape))
    return out


def grouped_allreduce(
    tensors: Sequence[Any], average: bool | None = None, device_dense: str = "",
    device_sparse: str = "", compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
    name: str | None = None,
) -> list[Any]:
    """Reduce several tensors across ranks in one fused operation.

    Args:
        tensors: Tensors, variables or ``tf.IndexedSlices`` (these are allgathered).
        average: Deprecated Horovod flag; prefer ``op``.
        device_dense: Accepted for Horovod compatibility; the collectives run on host
            memory.
        device_sparse: Accepted for Horovod compatibility; ignored likewise.
        ignore_name_scope: Accepted for Horovod compatibility; names are explicit.
        compression: How dense tensors travel (``Compression.none``/``fp16``).
        op: Average (default), Sum, Adasum, Min, Max or Product.
        prescale_factor: Multiply by this before the reduction.
        postscale_factor: Multiply by this after the reduction.
        process_set: The ranks taking part (all by default).
        name: Base name of the operation (same on every rank); automatic if None.

    Returns:
        One reduced tensor (or IndexedSlices) per input, in order.

    Raises:
        NotImplementedError: IndexedSlices with an op other than Sum/Average or with
            scale factors (as Horovod).
    """
    del device_dense, device_sparse, ignore_name_scope
    op = resolve_op(op, average)
    kernel.check_process_set(process_set, "grouped_allreduce")
    if not tensors:
        return list(tensors)
    out: list[Any] = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        sparse_name = kernel.eager_name("grouped_allreduce", name, process_set)
        sparse_name = None if sparse_name is None else f"{sparse_name}.sparse"
        _check_sparse(op, prescale_factor, postscale_factor, sparse_name, process_set)
        reduced = _sparse_group([tensors[i] for i in sparse], op, sparse_name, process_set)
        for i, r in zip(sparse, reduced):
            out[i] = r
    if dense:
        values = [tf.convert_to_tensor(tensors[i]) for i in dense]
        compressed, ctxs = zip(*(compression.compress(t) for t in values))
        reduced = _dense_group(list(compressed), op, prescale_factor, postscale_factor, name,
                               process_set)
        for i, r, c in zip(dense, reduced, ctxs):
            out[i] = compression.decompress(r, c)
    return out


def allreduce(
    tensor: Any, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
    compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: str | None = None,
    process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
) -> Any:
    """Reduce ``tensor`` across ranks (Average by default); differentiable for Sum/Average.

    ``tf.IndexedSlices`` are allgathered (values and indices) and, for Average, divided
    by the number of ranks, as Horovod does. See ``grouped_allreduce`` for the arguments.
    """
    del device_dense, device_sparse, ignore_name_scope
    op = resolve_op(op, average)
    kernel.check_process_set(process_set, "allreduce")
    if isinstance(tensor, tf.IndexedSlices):
        name = kernel.eager_name("allreduce", name, process_set)
        _check_sparse(op, prescale_factor, postscale_factor, name, process_set)
        return _sparse_group([tensor], op, name, process_set)[0]
    x = tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(x)
    reduced = _dense_group([compressed], op, prescale_factor, postscale_factor, name,
                           process_set, single=True)[0]
    return compression.decompress(reduced, ctx)


def _raw_reducescatter(tensors: list[tf.Tensor], op: ReduceOp, prescale: float,
                       postscale: float, name: str | None,
                       process_set: ProcessSet) -> list[tf.Tensor]:
    base = kernel.graph_name("reducescatter", name)

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        if len(arrays) == 1:
            return [C.reducescatter(arrays[0], base, op, prescale, postscale,
                                    process_set=process_set)]
        return C.grouped_reducescatter(list(arrays), base, op, prescale, postscale,
                                       process_set=process_set)

    outs = kernel.run(fn, tensors, [t.dtype for t in tensors])
    for o, t in zip(outs, tensors):
        o.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
    return outs


def _reducescatter_group(tensors: list[tf.Tensor], op: ReduceOp, prescale: float,
                         postscale: float, name: str | None,
                         process_set: ProcessSet) -> list[tf.Tensor]:
    if not (op in (ReduceOp.Average, ReduceOp.Sum)
            and all(t.dtype.is_floating for t in tensors)):
        return _raw_reducescatter(tensors, op, prescale, postscale, name, process_set)

    @tf.custom_gradient
    def with_grad(*xs):
        ys = _raw_reducescatter(list(xs), op, prescale, postscale, name, process_set)

        def grad(*dys):
            # Horovod's gradient: scale as the forward pass did, then gather the rows back.
            scale = prescale * postscale
            if op == ReduceOp.Sum:
                scale *= kernel.members_size(process_set)
            dys = [tf.convert_to_tensor(d) for d in dys]
            if scale != 1.0:
                dys = [d * tf.cast(scale, d.dtype) for d in dys]
            return grouped_allgather(dys, name=None if name is None else f"{name}.grad",
                                     process_set=process_set)

        return ys, grad

    return list(with_grad(*tensors))


def reducescatter(
    tensor: Any, device_dense: str = "", compression: type[Compressor] = Compression.none,
    op: ReduceOp = ReduceOp.Average, name: str | None = None,
    process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduce across ranks; each rank keeps its block of dim-0 rows (first ranks get more).

    Horovod's argument order: ``reducescatter(tensor, device_dense, compression, op,
    name, process_set, ignore_name_scope, prescale_factor, postscale_factor)``.
    """
    del device_dense, ignore_name_scope
    return grouped_reducescatter([tensor], compression=compression, op=op,
                                 process_set=process_set, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, name=name)[0]


def grouped_reducescatter(
    tensors: Sequence[Any], device_dense: str = "",
    compression: type[Compressor] = Compression.none, op: ReduceOp = ReduceOp.Average,
    process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
    postscale_factor: float = 1.0, name: str | None = None,
) -> list[tf.Tensor]:
    """Reduce-scatter several tensors in one fused operation (see ``reducescatter``)."""
    del device_dense
    op = resolve_op(op, None)
    if op not in (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max,
                  ReduceOp.Product):
        raise NotImplementedError(f"reducescatter does not support op={op.name}")
    kernel.check_process_set(process_set, "reducescatter")
    if not tensors:
        return list(tensors)
    name = kernel.eager_name("reducescatter", name, process_set)
    values = [tf.convert_to_tensor(t) for t in tensors]
    if any(t.shape.rank == 0 for t in values):
        keys = [name] if len(values) == 1 or name is None else [
            f"{name}.{i}" for i in range(len(values))]
        raise kernel.fail_locally("reducescatter", keys, process_set, ConfigError(
            "reducescatter needs tensors with at least one dimension (rows are scattered), "
            "got a scalar"))
    compressed, ctxs = zip(*(compression.compress(t) for t in values))
    reduced = _reducescatter_group(list(compressed), op, prescale_factor, postscale_factor,
                                   name, process_set)
    return [compression.decompress(r, c) for r, c in zip(reduced, ctxs)]
