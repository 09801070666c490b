"""Horovod's tensor collectives on ``torch.Tensor`` (module name kept for ported imports).

Out-of-place collectives are differentiable when their input requires grad; the
in-place and ``*_async`` variants are not, as in Horovod. Async calls return a
handle for ``synchronize``/``poll``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from hvd_spark import collectives as C
from hvd_spark.collectives.ops import Average, Max, Min, Product, ReduceOp, Sum
from hvd_spark.errors import ConfigError
from hvd_spark.torch import autograd as G
from hvd_spark.torch import tensor_ops as T
from hvd_spark.torch.compression import Compression, Compressor
from hvd_spark.torch.tensor_ops import TorchHandle, poll, synchronize

__all__ = [
    "Average", "Max", "Min", "Product", "ReduceOp", "Sum", "TorchHandle",
    "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "join", "poll", "reducescatter",
    "reducescatter_async", "synchronize",
]


def resolve_op(average: bool | None, op: ReduceOp | None) -> ReduceOp:
    """Horovod's deprecated ``average=`` flag or ``op=`` -> one ReduceOp (Average default)."""
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
            f"op={op!r} is not supported; use Sum, Average, Min, Max or Product "
            "(Adasum is not implemented)") from None


def _wants_grad(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0) -> TorchHandle:
    """Start reducing ``tensor`` across ranks; ``synchronize`` returns a new tensor."""
    return T.allreduce_async(tensor, name, resolve_op(average, op),
                             prescale_factor, postscale_factor)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` across ranks (Average by default); differentiable.

    Args:
        tensor: The tensor; every rank passes the same shape and dtype.
        average: Deprecated Horovod flag; use ``op``.
        name: Identical on every rank; automatic names need the same call order everywhere.
        compression: Applied before the wire and undone after.
        op: Sum, Average, Min, Max or Product.
        prescale_factor, postscale_factor: Multiply before / after the reduction.
    """
    T.check_tensor(tensor, "allreduce", name)
    op = resolve_op(average, op)
    wire, ctx = compression.compress(tensor)
    if _wants_grad(tensor):
        out = G.AllreduceFn.apply(wire, name, op, prescale_factor, postscale_factor)
    else:
        out = T.allreduce_async(wire, name, op, prescale_factor, postscale_factor).wait()
    return compression.decompress(out, ctx)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> TorchHandle:
    """Start an in-place allreduce; ``synchronize`` returns ``tensor`` holding the result."""
    return T.allreduce_async_(tensor, name, resolve_op(average, op),
                              prescale_factor, postscale_factor)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place (no copy for contiguous CPU tensors)."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor).wait()


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0) -> TorchHandle:
    """Start a fused allreduce of several tensors; ``synchronize`` returns a list."""
    return T.grouped_allreduce_async(tensors, name, resolve_op(average, op),
                                     prescale_factor, postscale_factor)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Allreduce several tensors as one fused operation; differentiable."""
    op = resolve_op(average, op)
    for t in tensors:
        T.check_tensor(t, "grouped_allreduce", name)
    packed = [compression.compress(t) for t in tensors]
    wires = [w for w, _ in packed]
    if any(_wants_grad(t) for t in tensors):
        outs = G.GroupedAllreduceFn.apply((name, op, prescale_factor, postscale_factor), *wires)
    else:
        outs = T.grouped_allreduce_async(wires, name, op, prescale_factor, postscale_factor).wait()
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed, strict=True)]


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0) -> TorchHandle:
    """Start a fused in-place allreduce of several tensors."""
    return T.grouped_allreduce_async(tensors, name, resolve_op(average, op),
                                     prescale_factor, postscale_factor, in_place=True)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: ReduceOp | None = None,
                       prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Allreduce several tensors in place as one fused operation."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                    postscale_factor).wait()


def allgather_async(tensor: torch.Tensor, name: str | None = None) -> TorchHandle:
    """Start concatenating every rank's tensor along dim 0."""
    return T.allgather_async(tensor, name)


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dims may differ); differentiable."""
    T.check_tensor(tensor, "allgather", name)
    if _wants_grad(tensor):
        return G.AllgatherFn.apply(tensor, name)
    return T.allgather_async(tensor, name).wait()


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> TorchHandle:
    """Start broadcasting root's tensor; ``synchronize`` returns a new tensor."""
    return T.broadcast_async(tensor, root_rank, name)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Return ``root_rank``'s tensor on every rank; differentiable."""
    T.check_tensor(tensor, "broadcast", name)
    if _wants_grad(tensor):
        return G.BroadcastFn.apply(tensor, root_rank, name)
    return T.broadcast_async(tensor, root_rank, name).wait()


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> TorchHandle:
    """Start an in-place broadcast into ``tensor``."""
    return T.broadcast_async_(tensor, root_rank, name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s, in place."""
    return T.broadcast_async_(tensor, root_rank, name).wait()


def alltoall_async(tensor: torch.Tensor, splits: Any = None,
                   name: str | None = None) -> TorchHandle:
    """Start an alltoall; ``synchronize`` returns ``(tensor, received_splits)``."""
    return T.alltoall_async(tensor, splits, name)


def alltoall(tensor: torch.Tensor, splits: Any = None,
             name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[j]`` rows to rank j (even split by default); differentiable.

    Returns:
        The rows received from every rank, concatenated in rank order, and how many
        rows came from each rank.
    """
    T.check_tensor(tensor, "alltoall", name)
    if _wants_grad(tensor):
        return G.AlltoallFn.apply(tensor, splits, name)
    return T.alltoall_async(tensor, splits, name).wait()


def reducescatter_async(tensor: torch.Tensor, name: str | None = None,
                        op: ReduceOp | None = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> TorchHandle:
    """Start a reduce-scatter along dim 0."""
    return T.reducescatter_async(tensor, name, resolve_op(None, op),
                                 prescale_factor, postscale_factor)


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce across ranks and return this rank's block of dim-0 rows; differentiable."""
    T.check_tensor(tensor, "reducescatter", name)
    op = resolve_op(None, op)
    wire, ctx = compression.compress(tensor)
    if _wants_grad(tensor):
        out = G.ReducescatterFn.apply(wire, name, op, prescale_factor, postscale_factor)
    else:
        out = T.reducescatter_async(wire, name, op, prescale_factor, postscale_factor).wait()
    return compression.decompress(out, ctx)


def barrier() -> None:
    """Return once every rank has called ``barrier``."""
    C.barrier()


def join(device: int = -1) -> int:
    """Wait until every rank has joined; returns the last rank to arrive.

    A simplification of Horovod's ``join``: this is a barrier, so ranks that joined
    early do not stand in (with zeros) for collectives the others still run. Give
    every rank the same number of batches (the data reader does) before calling it.
    ``device`` is accepted for compatibility and ignored.
    """
    del device
    arrivals = C.allgather(torch.tensor([time.time()], dtype=torch.float64).numpy(),
                           "hvd_spark.torch.join")
    return int(arrivals.argmax())
