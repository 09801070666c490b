"""Collectives on ``tf.Tensor``/``tf.Variable``, eager and inside ``tf.function``.

Every op runs the framework-free numpy collectives: directly when executing
eagerly, through one ``tf.numpy_function`` per call inside a graph. Graph ops get
names fixed at trace time (the graph's own unique names), so every execution of a
traced function asks the engine for the same names on every rank. Gradients flow
through ``allreduce``, ``grouped_allreduce``, ``allgather``, ``broadcast``,
``alltoall`` and ``reducescatter`` as in Horovod.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hvd_spark import collectives as C
from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.errors import ConfigError
from hvd_spark.tensorflow.compression import Compression, Compressor

# Unnamed eager grouped ops need one base name for their per-dtype buffers; ranks
# number them identically because eager code runs in program order.
_eager_ids = itertools.count()


def _graph_name(kind: str, name: str | None) -> str | None:
    """The engine name of one op: the user's, the graph's unique one, or None (eager)."""
    if name is not None:
        return name
    if tf.executing_eagerly():
        return None  # the collectives number unnamed eager ops in program order
    return tf.compat.v1.get_default_graph().unique_name(f"hvd_{kind}")


def _run(fn: Callable[..., list[np.ndarray]], inputs: Sequence[Any],
         touts: Sequence[tf.DType]) -> list[tf.Tensor]:
    """Run ``fn`` on numpy views of ``inputs``: now if eager, as a graph op otherwise."""
    if tf.executing_eagerly():
        outs = fn(*[np.asarray(t) for t in inputs])
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, touts)]
    outs = tf.numpy_function(fn, list(inputs), list(touts), stateful=True)
    return list(outs)


def _resolve_op(op: ReduceOp | None, average: bool | None) -> ReduceOp:
    if op is not None and average is not None:
        raise ConfigError("allreduce: pass either op= or the deprecated average=, not both")
    if op is None:
        return ReduceOp.Sum if average is False else ReduceOp.Average
    return ReduceOp(op)


def fused_allreduce_np(arrays: Sequence[np.ndarray], name: str, op: ReduceOp,
                       prescale: float = 1.0, postscale: float = 1.0) -> list[np.ndarray]:
    """Allreduce several arrays as one buffer per dtype; returns new arrays.

    One flat buffer per dtype makes a rank with a different set of tensors fail with a
    size disagreement naming ``name`` instead of waiting for names that never come.
    """
    out: list[np.ndarray | None] = [None] * len(arrays)
    by_dtype: dict[np.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(np.asarray(a).dtype, []).append(i)
    for dtype in sorted(by_dtype, key=str):
        idx = by_dtype[dtype]
        flat = np.concatenate([np.asarray(arrays[i]).reshape(-1) for i in idx])
        C.allreduce_(flat, f"{name}.{dtype}", op, prescale, postscale)
        offset = 0
        for i in idx:
            shape = np.shape(arrays[i])
            n = int(np.prod(shape))
            out[i] = flat[offset : offset + n].reshape(shape)
            offset += n
    return out  # type: ignore[return-value]


def _raw_grouped_allreduce(tensors: list[tf.Tensor], op: ReduceOp, prescale: float,
                           postscale: float, name: str | None) -> list[tf.Tensor]:
    engine_name = _graph_name("grouped_allreduce", name) or f"tf.grouped.{next(_eager_ids)}"

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        return fused_allreduce_np(arrays, engine_name, op, prescale, postscale)

    outs = _run(fn, tensors, [t.dtype for t in tensors])
    for o, t in zip(outs, tensors):
        o.set_shape(t.shape)
    return outs


def grouped_allreduce(
    tensors: Sequence[tf.Tensor], average: bool | None = None,
    compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: str | None = None,
) -> list[tf.Tensor]:
    """Reduce several tensors across ranks in one fused operation.

    Args:
        tensors: Dense tensors or variables (IndexedSlices are densified).
        average: Deprecated Horovod flag; prefer ``op``.
        compression: How to compress the tensors on the wire.
        op: Average (default), Sum, Min, Max or Product.
        prescale_factor, postscale_factor: Multiply before/after the reduction.
        name: Base name of the operation (same on every rank); automatic if None.

    Returns:
        One reduced tensor per input, same shapes and dtypes.
    """
    op = _resolve_op(op, average)
    dense = [tf.convert_to_tensor(t) for t in tensors]
    if not dense:
        return []
    compressed, ctxs = zip(*(compression.compress(t) for t in dense))
    differentiable = op in (ReduceOp.Average, ReduceOp.Sum) and all(
        t.dtype.is_floating for t in compressed)

    def forward(*xs: tf.Tensor) -> list[tf.Tensor]:
        return _raw_grouped_allreduce(list(xs), op, prescale_factor, postscale_factor, name)

    if differentiable:
        @tf.custom_gradient
        def with_grad(*xs):
            ys = forward(*xs)

            def grad(*dys):
                gname = None if name is None else f"{name}.grad"
                return _raw_grouped_allreduce(
                    [tf.convert_to_tensor(d) for d in dys], op, prescale_factor,
                    postscale_factor, gname)

            return ys, grad

        reduced = with_grad(*compressed)
    else:
        reduced = forward(*compressed)
    return [compression.decompress(r, c) for r, c in zip(reduced, ctxs)]


def allreduce(
    tensor: Any, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
    compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: str | None = None,
) -> Any:
    """Reduce ``tensor`` across ranks (Average by default); differentiable for Sum/Average.

    ``tf.IndexedSlices`` are allgathered (values and indices), as Horovod does, and
    divided by the number of ranks for Average. ``device_*`` are accepted for
    compatibility and ignored (the collectives work on host memory).
    """
    del device_dense, device_sparse
    op = _resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        if op not in (ReduceOp.Average, ReduceOp.Sum):
            raise ConfigError(f"allreduce of IndexedSlices {name!r} supports Sum/Average only")
        values = allgather(tensor.values, name=None if name is None else f"{name}.values")
        indices = allgather(tensor.indices, name=None if name is None else f"{name}.indices")
        if op == ReduceOp.Average:
            values = values / tf.cast(C.size(), values.dtype)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    return grouped_allreduce([tensor], compression=compression, op=op,
                             prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, name=name)[0]


def _raw_allgather(tensor: tf.Tensor, name: str | None) -> tf.Tensor:
    engine_name = _graph_name("allgather", name)
    out = _run(lambda a: [C.allgather(a, engine_name)], [tensor], [tensor.dtype])[0]
    out.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    return out


def allgather(tensor: Any, name: str | None = None) -> tf.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dims may differ)."""
    x = tf.convert_to_tensor(tensor)
    if x.shape.rank == 0:
        x = tf.reshape(x, [1])
    if not x.dtype.is_floating:
        return _raw_allgather(x, name)

    @tf.custom_gradient
    def with_grad(v):
        def grad(dy):
            summed = _raw_grouped_allreduce([tf.convert_to_tensor(dy)], ReduceOp.Sum, 1.0, 1.0,
                                            None if name is None else f"{name}.grad")[0]
            rows = _raw_allgather(tf.shape(v, out_type=tf.int64)[:1],
                                  None if name is None else f"{name}.grad_rows")
            start = tf.reduce_sum(rows[: C.rank()])
            return summed[start : start + tf.shape(v, out_type=tf.int64)[0]]

        return _raw_allgather(v, name), grad

    return with_grad(x)


def _raw_broadcast(tensor: tf.Tensor, root_rank: int, name: str | None) -> tf.Tensor:
    engine_name = _graph_name("broadcast", name)
    out = _run(lambda a: [C.broadcast(a, root_rank, engine_name)], [tensor], [tensor.dtype])[0]
    out.set_shape(tensor.shape)
    return out


def broadcast(tensor: Any, root_rank: int, name: str | None = None) -> tf.Tensor:
    """Return root's ``tensor`` on every rank; the gradient reaches the root only."""
    x = tf.convert_to_tensor(tensor)
    if not x.dtype.is_floating:
        return _raw_broadcast(x, root_rank, name)

    @tf.custom_gradient
    def with_grad(v):
        def grad(dy):
            gname = None if name is None else f"{name}.grad"
            summed = _raw_grouped_allreduce([tf.convert_to_tensor(dy)], ReduceOp.Sum, 1.0, 1.0,
                                            gname)[0]
            return summed if C.rank() == root_rank else tf.zeros_like(summed)

        return _raw_broadcast(v, root_rank, name), grad

    return with_grad(x)


def _raw_alltoall(tensor: tf.Tensor, splits: tf.Tensor, name: str | None):
    engine_name = _graph_name("alltoall", name)

    def fn(a: np.ndarray, s: np.ndarray) -> list[np.ndarray]:
        out, recv = C.alltoall(a, None if s.size == 0 else s, engine_name)
        return [out, np.asarray(recv, np.int32)]

    out, recv = _run(fn, [tensor, splits], [tensor.dtype, tf.int32])
    out.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    recv.set_shape([None])
    return out, recv


def alltoall(tensor: Any, splits: Any = None, name: str | None = None):
    """Send ``splits[j]`` rows to rank j (even split if None).

    Returns:
        ``(received, received_splits)``, as Horovod's TensorFlow ``alltoall``.
    """
    x = tf.convert_to_tensor(tensor)
    s = tf.zeros([0], tf.int32) if splits is None else tf.cast(tf.reshape(splits, [-1]), tf.int32)
    if not x.dtype.is_floating:
        return _raw_alltoall(x, s, name)

    @tf.custom_gradient
    def with_grad(v):
        out, recv = _raw_alltoall(v, s, name)

        def grad(dy, _drecv=None):
            back, _ = _raw_alltoall(tf.convert_to_tensor(dy), recv,
                                    None if name is None else f"{name}.grad")
            return back

        return (out, recv), grad

    return with_grad(x)


def reducescatter(tensor: Any, op: ReduceOp = ReduceOp.Average, name: str | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce across ranks; each rank keeps its block of dim-0 rows."""
    x = tf.convert_to_tensor(tensor)
    op = ReduceOp(op)

    def raw(v: tf.Tensor) -> tf.Tensor:
        engine_name = _graph_name("reducescatter", name)
        out = _run(lambda a: [C.reducescatter(a, engine_name, op, prescale_factor,
                                              postscale_factor)], [v], [v.dtype])[0]
        out.set_shape(tf.TensorShape([None]).concatenate(v.shape[1:]))
        return out

    if not (x.dtype.is_floating and op in (ReduceOp.Average, ReduceOp.Sum)):
        return raw(x)

    @tf.custom_gradient
    def with_grad(v):
        def grad(dy):
            full = _raw_allgather(tf.convert_to_tensor(dy),
                                  None if name is None else f"{name}.grad")
            scale = prescale_factor * postscale_factor
            if op == ReduceOp.Average:
                scale /= C.size()
            return full * tf.cast(scale, full.dtype) if scale != 1.0 else full

        return raw(v), grad

    return with_grad(x)


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        name: str | None = None) -> None:
    """Overwrite every variable with root's value (one fused broadcast per dtype).

    Eagerly, the ranks first check that they hold the same number of variables with
    the same dtypes, so a mismatch is an error on every rank rather than a hang.
    """
    variables = list(variables)
    base = name or "broadcast_variables"
    if tf.executing_eagerly():
        signature = [(tuple(v.shape), tf.as_dtype(v.dtype).name) for v in variables]
        check_same_everywhere(signature, f"{base}.check", "broadcast_variables")
    values = _grouped_broadcast([tf.convert_to_tensor(v) for v in variables], root_rank,
                                _graph_name("broadcast_variables", name) or base)
    for var, value in zip(variables, values):
        var.assign(value)


def check_same_everywhere(value: Any, name: str, what: str) -> None:
    """Raise ConfigError on every rank unless ``value`` is equal on all ranks."""
    seen = C.allgather_object(value, name)
    bad = [r for r, v in enumerate(seen) if v != seen[0]]
    if bad:
        raise ConfigError(
            f"{what}: ranks {bad} disagree with rank 0 on the tensors involved "
            f"({_difference(seen[0], seen[bad[0]], bad[0])}); "
            "build the same model and optimizer on every rank"
        )


def _difference(first: Any, other: Any, rank: int) -> str:
    if isinstance(first, list) and isinstance(other, list):
        if len(first) != len(other):
            return f"rank 0 has {len(first)} tensors, rank {rank} has {len(other)}"
        i = next(i for i, (a, b) in enumerate(zip(first, other)) if a != b)
        return f"tensor #{i}: rank 0 has {first[i]}, rank {rank} has {other[i]}"
    return f"rank 0: {first!r}, rank {rank}: {other!r}"


def _grouped_broadcast(tensors: list[tf.Tensor], root_rank: int, name: str) -> list[tf.Tensor]:
    if not tensors:
        return []

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        out: list[np.ndarray | None] = [None] * len(arrays)
        by_dtype: dict[np.dtype, list[int]] = {}
        for i, a in enumerate(arrays):
            by_dtype.setdefault(a.dtype, []).append(i)
        for dtype in sorted(by_dtype, key=str):
            idx = by_dtype[dtype]
            flat = np.concatenate([arrays[i].reshape(-1) for i in idx])
            C.broadcast_(flat, root_rank, f"{name}.{dtype}")
            offset = 0
            for i in idx:
                out[i] = flat[offset : offset + arrays[i].size].reshape(arrays[i].shape)
                offset += arrays[i].size
        return out  # type: ignore[return-value]

    outs = _run(fn, tensors, [t.dtype for t in tensors])
    for o, t in zip(outs, tensors):
        o.set_shape(t.shape)
    return outs
