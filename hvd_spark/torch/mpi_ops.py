"""Horovod's tensor collectives on ``torch.Tensor`` (module name kept for ported imports).

Out-of-place collectives are differentiable when their input requires grad; the
in-place and ``*_async`` variants are not, as in Horovod. Async calls return a
handle for ``synchronize``/``poll``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hvd_spark import collectives as C
from hvd_spark.collectives import ProcessSet, global_process_set
from hvd_spark.collectives.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from hvd_spark.errors import ConfigError
from hvd_spark.torch import autograd as G
from hvd_spark.torch import tensor_ops as T
from hvd_spark.torch.compression import Compression, Compressor
from hvd_spark.torch.handles import TorchHandle, poll, synchronize

__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "ReduceOp", "Sum", "TorchHandle",
    "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "sparse_allreduce_async",
    "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "join", "poll", "reducescatter",
    "reducescatter_async", "synchronize",
]


def resolve_op(average: bool | None, op: ReduceOp | None) -> ReduceOp:
    """Horovod's deprecated ``average=`` flag or ``op=`` -> one ReduceOp (Average default)."""
    if type(op) is ReduceOp and average is None:
        return op  # the usual case, without the enum's lookup (two Python calls)
    if average is not None and op is not None:
        raise ConfigError("pass either average= (deprecated) or op=, not both")
    if average is not None:
        return ReduceOp.Average if average else ReduceOp.Sum
    if op is None:
        return ReduceOp.Average
    try:
        return ReduceOp(op)
    except ValueError:
        raise ConfigError(
            f"op={op!r} is not supported; use Sum, Average, Adasum, Min, Max or Product") from None


def _wants_grad(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start reducing ``tensor`` across ranks; ``synchronize`` returns a new tensor."""
    return T.allreduce_async(tensor, name, resolve_op(average, op),
                             prescale_factor, postscale_factor, process_set)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across ranks (Average by default); differentiable.

    Args:
        tensor: The tensor; every rank passes the same shape and dtype.
        average: Deprecated Horovod flag; use ``op``.
        name: Identical on every rank; automatic names need the same call order everywhere.
        compression: Applied before the wire and undone after.
        op: Sum, Average, Min, Max or Product.
        prescale_factor: Multiply by this before the reduction.
        postscale_factor: Multiply by this after the reduction.
    """
    if compression is Compression.none and not _wants_grad(tensor):
        # Nothing to compress or differentiate: T.allreduce checks the tensor (once).
        return T.allreduce(tensor, name, resolve_op(average, op), prescale_factor,
                           postscale_factor, process_set)
    T.checked_tensor(tensor, "allreduce", "allreduce", name, process_set)
    op = resolve_op(average, op)
    wire, ctx = compression.compress(tensor)
    if _wants_grad(tensor):
        out = G.AllreduceFn.apply(wire, name, op, prescale_factor, postscale_factor,
                                  process_set)
    else:
        out = T.allreduce(wire, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start an in-place allreduce; ``synchronize`` returns ``tensor`` holding the result."""
    return T.allreduce_async_(tensor, name, resolve_op(average, op),
                              prescale_factor, postscale_factor, process_set)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place (no copy for contiguous CPU tensors)."""
    return T.allreduce_(tensor, name, resolve_op(average, op), prescale_factor,
                        postscale_factor, process_set)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start a fused allreduce of several tensors; ``synchronize`` returns a list."""
    return T.grouped_allreduce_async(tensors, name, resolve_op(average, op),
                                     prescale_factor, postscale_factor,
                                     process_set=process_set)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce several tensors as one fused operation; differentiable."""
    op = resolve_op(average, op)
    T.check_grouped_allreduce(tensors, name, process_set)
    packed = [compression.compress(t) for t in tensors]
    wires = [w for w, _ in packed]
    if any(_wants_grad(t) for t in tensors):
        outs = G.GroupedAllreduceFn.apply(
            (name, op, prescale_factor, postscale_factor, process_set), *wires)
    else:
        outs = T.grouped_allreduce_async(wires, name, op, prescale_factor, postscale_factor,
                                         process_set=process_set).wait()
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed, strict=True)]


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start a fused in-place allreduce of several tensors."""
    return T.grouped_allreduce_async(tensors, name, resolve_op(average, op),
                                     prescale_factor, postscale_factor, in_place=True,
                                     process_set=process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: ReduceOp | None = None,
                       prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
        process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce several tensors in place as one fused operation."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                    postscale_factor, process_set).wait()


def allgather_async(tensor: torch.Tensor, name: str | None = None,
        process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start concatenating every rank's tensor along dim 0."""
    return T.allgather_async(tensor, name, process_set)


def allgather(tensor: torch.Tensor, name: str | None = None,
        process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dims may differ); differentiable."""
    T.checked_tensor(tensor, "allgather", "allgather", name, process_set)
    if _wants_grad(tensor):
        return G.AllgatherFn.apply(tensor, name, process_set)
    return T.allgather(tensor, name, process_set)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
        process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start broadcasting root's tensor; ``synchronize`` returns a new tensor."""
    return T.broadcast_async(tensor, root_rank, name, process_set)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
        process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s tensor on every rank; differentiable."""
    T.checked_tensor(tensor, "broadcast", "broadcast", name, process_set)
    if _wants_grad(tensor):
        return G.BroadcastFn.apply(tensor, root_rank, name, process_set)
    return T.broadcast(tensor, root_rank, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
        process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start an in-place broadcast into ``tensor``."""
    return T.broadcast_async_(tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
        process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s, in place."""
    return T.broadcast_(tensor, root_rank, name, process_set)


def alltoall_async(tensor: torch.Tensor, splits: Any = None,
                   name: str | None = None,
        process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start an alltoall; ``synchronize`` returns ``(tensor, received_splits)``."""
    return T.alltoall_async(tensor, splits, name, process_set)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows to rank j (even split by default); differentiable.

    Returns:
        The rows received from every rank, concatenated in rank order; when ``splits``
        was given, also how many rows came from each rank (Horovod's convention).
    """
    T.checked_tensor(tensor, "alltoall", "alltoall", name, process_set)
    if _wants_grad(tensor):
        out, received = G.AlltoallFn.apply(tensor, splits, name, process_set)
    else:
        out, received = T.alltoall_async(tensor, splits, name, process_set).wait()
    return out if splits is None else (out, received)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None,
                        op: ReduceOp | None = None,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> TorchHandle:
    """Start a reduce-scatter along dim 0."""
    return T.reducescatter_async(tensor, name, resolve_op(None, op),
                                 prescale_factor, postscale_factor, process_set)


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
                  process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce across ranks and return this rank's block of dim-0 rows; differentiable.

    Arguments in Horovod's order (``process_set`` before the scale factors).
    """
    T.checked_tensor(tensor, "reducescatter", "reducescatter", name, process_set)
    op = resolve_op(None, op)
    wire, ctx = compression.compress(tensor)
    if _wants_grad(tensor):
        out = G.ReducescatterFn.apply(wire, name, op, prescale_factor, postscale_factor,
                                      process_set)
    else:
        out = T.reducescatter_async(wire, name, op, prescale_factor, postscale_factor,
                                    process_set).wait()
    return compression.decompress(out, ctx)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank (of ``process_set``) has called ``barrier``."""
    C.barrier(process_set=process_set)


def join(device: int = -1) -> int:
    """Horovod's ``join``: until every rank has joined, this rank takes part in the others'
    allreduces with zeros, so ranks with fewer batches never hang the rest.

    Returns:
        The last rank to join (the same on every rank). ``device`` is accepted for
        compatibility and ignored (collectives run on the CPU).
    """
    del device
    return C.join()


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: ReduceOp = Average,
                           process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start an allreduce of a sparse COO tensor by allgathering its indices and values.

    ``synchronize`` returns a coalesced sparse tensor: the sum (or, with Average, the
    mean) of every rank's tensor, as Horovod computes it.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise ConfigError("sparse_allreduce_async expects a sparse COO tensor (tensor.to_sparse())")
    op = resolve_op(None, op)
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ConfigError(f"sparse_allreduce_async supports Sum and Average, not {op.name}")
    t = tensor.coalesce()
    indices = t.indices().t().contiguous()  # one row per non-zero, so allgather concatenates
    values = t.values().contiguous()
    h_idx = T.allgather_async(indices, f"{name}.indices", process_set)
    h_val = T.allgather_async(values, f"{name}.values", process_set)
    n = process_set.size() if process_set is not global_process_set else C.size()

    def finish(_: list) -> torch.Tensor:
        all_idx, all_val = h_idx.wait(), h_val.wait()
        if op == ReduceOp.Average:
            all_val = all_val / n
        out = torch.sparse_coo_tensor(all_idx.t(), all_val, size=tensor.shape)
        return out.coalesce()

    return TorchHandle([*h_idx.inner, *h_val.inner], finish)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start allgathers of several tensors; ``synchronize`` returns a list."""
    return T.grouped_allgather_async(tensors, name, process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather several tensors (each concatenated along dim 0 over the ranks); differentiable."""
    base = T.group_base("allgather", tensors, name, process_set)
    return [allgather(t, f"{base}.{i}", process_set) for i, t in enumerate(tensors)]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ReduceOp | None = None,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> TorchHandle:
    """Start reduce-scatters of several tensors; ``synchronize`` returns a list."""
    return T.grouped_reducescatter_async(tensors, name, resolve_op(None, op), prescale_factor,
                                         postscale_factor, process_set)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none,
                          op: ReduceOp | None = None,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce-scatter several tensors; returns this rank's block of each; differentiable."""
    base = T.group_base("reducescatter", tensors, name, process_set)
    return [reducescatter(t, f"{base}.{i}", compression, op, process_set, prescale_factor,
                          postscale_factor) for i, t in enumerate(tensors)]
