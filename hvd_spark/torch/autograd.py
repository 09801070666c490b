"""Autograd through the collectives: each forward collective has a backward collective.

The gradients assume the training objective is the sum of the ranks' losses (the
DistributedOptimizer then averages parameter gradients), so a tensor every rank
receives (allgather, broadcast) sends back the *sum* of the ranks' gradients.

Backward collectives are named ``<name>.grad`` when the forward one was named;
unnamed ones get automatic names, which match across ranks as long as every rank
runs the same collectives in the same order.
"""

from __future__ import annotations

from typing import Any

import torch

from hvd_spark import collectives as C
from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.torch import tensor_ops as T


def _grad_name(name: str | None) -> str | None:
    return None if name is None else f"{name}.grad"


class AllreduceFn(torch.autograd.Function):
    """allreduce; backward: allreduce of the gradient with the same op and scaling."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp,
                prescale: float, postscale: float) -> torch.Tensor:
        ctx.args = (name, op, prescale, postscale)
        return T.allreduce_async(tensor, name, op, prescale, postscale).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        name, op, prescale, postscale = ctx.args
        out = T.allreduce_async(grad.contiguous(), _grad_name(name), op, prescale, postscale)
        return out.wait(), None, None, None, None


class GroupedAllreduceFn(torch.autograd.Function):
    """grouped_allreduce; backward: grouped allreduce of the gradients."""

    @staticmethod
    def forward(ctx: Any, args: tuple, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = args
        name, op, prescale, postscale = args
        return tuple(T.grouped_allreduce_async(list(tensors), name, op, prescale, postscale).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        name, op, prescale, postscale = ctx.args
        grads = [g.contiguous() for g in grads]
        out = T.grouped_allreduce_async(grads, _grad_name(name), op, prescale, postscale).wait()
        return (None, *out)


class AllgatherFn(torch.autograd.Function):
    """allgather; backward: sum the gradient over ranks and keep this rank's rows."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None) -> torch.Tensor:
        ctx.name = name
        ctx.shape = tensor.shape
        return T.allgather_async(tensor, name).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        name = _grad_name(ctx.name)
        summed = T.allreduce_async(grad.contiguous(), name, ReduceOp.Sum).wait()
        rows = 1 if len(ctx.shape) == 0 else ctx.shape[0]
        dims_name = None if name is None else f"{name}.dims"
        dims = C.allgather(torch.tensor([rows]).numpy(), dims_name)
        start = int(dims[: C.rank()].sum())
        return summed[start : start + rows].reshape(ctx.shape), None


class BroadcastFn(torch.autograd.Function):
    """broadcast; backward: the root gets the sum of the ranks' gradients, others zeros."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None):
        ctx.args = (root_rank, name)
        return T.broadcast_async(tensor, root_rank, name).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        root_rank, name = ctx.args
        summed = T.allreduce_async(grad.contiguous(), _grad_name(name), ReduceOp.Sum).wait()
        if C.rank() != root_rank:
            summed = torch.zeros_like(summed)
        return summed, None, None


class AlltoallFn(torch.autograd.Function):
    """alltoall; backward: send each gradient block back where its rows came from."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None):
        out, received = T.alltoall_async(tensor, splits, name).wait()
        ctx.received = received
        ctx.name = name
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> tuple:
        out, _ = T.alltoall_async(grad.contiguous(), ctx.received, _grad_name(ctx.name)).wait()
        return out, None, None


class ReducescatterFn(torch.autograd.Function):
    """reducescatter; backward: gather the row-block gradients (divided by size for Average)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp,
                prescale: float, postscale: float) -> torch.Tensor:
        ctx.args = (name, op, prescale * postscale)
        return T.reducescatter_async(tensor, name, op, prescale, postscale).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        name, op, scale = ctx.args
        gathered = T.allgather_async(grad.contiguous(), _grad_name(name)).wait()
        if op == ReduceOp.Average:
            scale /= C.size()
        if scale != 1.0:
            gathered = gathered * scale
        return gathered, None, None, None, None
