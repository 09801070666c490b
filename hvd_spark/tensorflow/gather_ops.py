"""Allgather, broadcast and alltoall on TensorFlow tensors, with Horovod's gradients.

Every op runs the numpy collectives through ``kernel.run``: at once when eager, as a
deadlock-free graph node inside ``tf.function`` or a TF1-style session.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hvd_spark import collectives as C
from hvd_spark.collectives import _plumbing
from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.collectives.process_sets import ProcessSet, global_process_set
from hvd_spark.errors import ConfigError
from hvd_spark.tensorflow import kernel


def _average(tensors: list[tf.Tensor], name: str | None,
             process_set: ProcessSet) -> list[tf.Tensor]:
    """Average gradients across ranks (the building block of the gather gradients)."""
    base = kernel.graph_name("grad_allreduce", name)
    outs = kernel.run(
        lambda *a: C.grouped_allreduce(list(a), base, ReduceOp.Average,
                                       process_set=process_set),
        tensors, [t.dtype for t in tensors])
    for o, t in zip(outs, tensors):
        o.set_shape(t.shape)
    return outs


def _raw_grouped_allgather(tensors: list[tf.Tensor], name: str | None,
                           process_set: ProcessSet) -> list[tf.Tensor]:
    base = kernel.graph_name("allgather", name)

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        if len(arrays) == 1:
            return [C.allgather(arrays[0], base, process_set=process_set)]
        return C.grouped_allgather(list(arrays), base, process_set=process_set)

    outs = kernel.run(fn, tensors, [t.dtype for t in tensors])
    for o, t in zip(outs, tensors):
        o.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
    return outs


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Concatenate every rank's tensors along dim 0, several tensors in one operation.

    First dimensions may differ between ranks; the others must match. Differentiable for
    floating-point tensors (Horovod's gradient: average, then keep this rank's rows).
    """
    del ignore_name_scope
    kernel.check_process_set(process_set, "allgather")
    xs = [tf.convert_to_tensor(t) for t in tensors]
    if not xs:
        return []
    xs = [tf.reshape(x, [1]) if x.shape.rank == 0 else x for x in xs]
    if not (kernel.needs_gradient() and all(x.dtype.is_floating for x in xs)):
        return _raw_grouped_allgather(xs, name, process_set)

    @tf.custom_gradient
    def with_grad(*vs):
        def grad(*dys):
            gname = None if name is None else f"{name}.grad"
            summed = _average([tf.convert_to_tensor(d) for d in dys], gname, process_set)
            rows = _raw_grouped_allgather(
                [tf.shape(v, out_type=tf.int64)[:1] for v in vs],
                None if name is None else f"{name}.grad_rows", process_set)
            me = _set_rank(process_set)
            out = []
            for g, r, v in zip(summed, rows, vs):
                start = tf.reduce_sum(r[:me])
                out.append(g[start : start + tf.shape(v, out_type=tf.int64)[0]])
            return out

        return _raw_grouped_allgather(list(vs), name, process_set), grad

    return list(with_grad(*xs))


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dims may differ)."""
    return grouped_allgather([tensor], name, ignore_name_scope, process_set)[0]


def _set_rank(process_set: ProcessSet) -> int:
    if process_set is global_process_set:
        return C.rank()
    r = process_set.rank()
    if r is None or r < 0:
        raise ConfigError(f"rank {C.rank()} is not a member of {process_set}")
    return r


def _raw_broadcast(tensors: list[tf.Tensor], root_rank: int, name: str | None,
                   process_set: ProcessSet) -> list[tf.Tensor]:
    base = kernel.graph_name("broadcast", name)
    if base is None and len(tensors) > 1:
        base = _plumbing.auto_name("grouped_broadcast", None, process_set)

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        if len(arrays) == 1:
            return [C.broadcast(arrays[0], root_rank, base, process_set=process_set)]
        handles = [C.broadcast_async(a, root_rank, f"{base}.{i}", process_set=process_set)
                   for i, a in enumerate(arrays)]
        return [C.synchronize(h) for h in handles]

    outs = kernel.run(fn, tensors, [t.dtype for t in tensors])
    for o, t in zip(outs, tensors):
        o.set_shape(t.shape)
    return outs


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Return root's ``tensor`` on every rank; the gradient (averaged) reaches the root only."""
    del ignore_name_scope
    kernel.check_process_set(process_set, "broadcast")
    x = tf.convert_to_tensor(tensor)
    if not (kernel.needs_gradient() and x.dtype.is_floating):
        return _raw_broadcast([x], root_rank, name, process_set)[0]

    @tf.custom_gradient
    def with_grad(v):
        def grad(dy):
            gname = None if name is None else f"{name}.grad"
            averaged = _average([tf.convert_to_tensor(dy)], gname, process_set)[0]
            return averaged if C.rank() == root_rank else averaged * 0

        return _raw_broadcast([v], root_rank, name, process_set)[0], grad

    return with_grad(x)


def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Overwrite each variable with root's value in place; returns the new values.

    Eagerly the variables are assigned at once; in a graph the returned tensors depend
    on the assignments, so evaluating them (or the variables afterwards) sees root's data.
    """
    variables = list(variables)
    kernel.check_process_set(process_set, "broadcast_")
    if not variables:
        return []
    values = _raw_broadcast([tf.convert_to_tensor(v) for v in variables], root_rank, name,
                            process_set)
    if tf.executing_eagerly():
        for var, value in zip(variables, values):
            var.assign(value)
        return [tf.convert_to_tensor(var) for var in variables]
    assigns = [var.assign(value) for var, value in zip(variables, values)]
    with tf.control_dependencies(assigns):
        return [tf.identity(value) for value in values]


def _raw_alltoall(tensor: tf.Tensor, splits: tf.Tensor, name: str | None,
                  process_set: ProcessSet):
    engine_name = kernel.graph_name("alltoall", name)

    def fn(a: np.ndarray, s: np.ndarray) -> list[np.ndarray]:
        out, recv = C.alltoall(a, None if s.size == 0 else s, engine_name,
                               process_set=process_set)
        return [out, np.asarray(recv, np.int32)]

    out, recv = kernel.run(fn, [tensor, splits], [tensor.dtype, tf.int32])
    out.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    recv.set_shape([None])
    return out, recv


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows to rank j (an even split if None).

    Returns:
        As Horovod: the received rows, and with ``splits`` given also the number of rows
        received from each rank (``(received, received_splits)``).

    Raises:
        tf.errors.InvalidArgumentError: ``splits`` do not add up to the rows, or the
            even split does not divide them (checked before anything is sent).
    """
    del ignore_name_scope
    kernel.check_process_set(process_set, "alltoall")
    name = kernel.eager_name("alltoall", name, process_set)
    x = tf.convert_to_tensor(tensor)
    if x.shape.rank == 0:
        raise kernel.fail_locally("alltoall", [name], process_set, ConfigError(
            "alltoall needs a tensor with at least one dimension, got a scalar"))
    s = tf.zeros([0], tf.int32) if splits is None else tf.cast(tf.reshape(splits, [-1]),
                                                                tf.int32)
    if tf.executing_eagerly():
        try:
            _check_splits(x, s, process_set)
        except tf.errors.InvalidArgumentError as exc:
            raise kernel.fail_locally("alltoall", [name], process_set, exc) from None
    if not (kernel.needs_gradient() and x.dtype.is_floating):
        out, recv = _raw_alltoall(x, s, name, process_set)
    else:
        @tf.custom_gradient
        def with_grad(v):
            out, recv = _raw_alltoall(v, s, name, process_set)

            def grad(dy, _drecv=None):
                back, _ = _raw_alltoall(tf.convert_to_tensor(dy), recv,
                                        None if name is None else f"{name}.grad", process_set)
                return back

            return (out, recv), grad

        out, recv = with_grad(x)
    return (out, recv) if splits is not None else out


def _check_splits(x: tf.Tensor, s: tf.Tensor, process_set: ProcessSet) -> None:
    """Horovod rejects bad splits locally with InvalidArgumentError, before any exchange."""
    rows = int(x.shape[0])
    n = kernel.members_size(process_set)
    splits = s.numpy().tolist()
    if not splits:
        if rows % n:
            raise tf.errors.InvalidArgumentError(
                None, None, f"alltoall: {rows} rows cannot be split evenly among {n} ranks; "
                "pass splits=")
        return
    if len(splits) != n or any(v < 0 for v in splits) or sum(splits) != rows:
        raise tf.errors.InvalidArgumentError(
            None, None, f"alltoall: splits {splits} must be {n} non-negative counts adding "
            f"up to the {rows} rows of the tensor")
