"""Autograd through the collectives: each forward collective has a backward collective.

As in Horovod, a tensor every rank receives (allgather, broadcast) sends back the
*average* of the ranks' gradients: the objective is taken to be the mean of the
ranks' losses, matching DistributedOptimizer's averaged parameter gradients.

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
                prescale: float, postscale: float, process_set: Any) -> torch.Tensor:
        ctx.args = (name, op, prescale, postscale, process_set)
        return T.allreduce(tensor, name, op, prescale, postscale, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        name, op, prescale, postscale, ps = ctx.args
        out = T.allreduce(grad.contiguous(), _grad_name(name), op, prescale, postscale, ps)
        return out, None, None, None, None, None


class GroupedAllreduceFn(torch.autograd.Function):
    """grouped_allreduce; backward: grouped allreduce of the gradients."""

    @staticmethod
    def forward(ctx: Any, args: tuple, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = args
        name, op, prescale, postscale, ps = args
        return tuple(T.grouped_allreduce_async(list(tensors), name, op, prescale, postscale,
                                               process_set=ps).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        name, op, prescale, postscale, ps = ctx.args
        grads = [g.contiguous() for g in grads]
        out = T.grouped_allreduce_async(grads, _grad_name(name), op, prescale, postscale,
                                        process_set=ps).wait()
        return (None, *out)


class AllgatherFn(torch.autograd.Function):
    """allgather; backward: average the gradient over ranks and keep this rank's rows."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, ps: Any) -> torch.Tensor:
        ctx.name, ctx.ps = name, ps
        ctx.shape = tensor.shape
        return T.allgather_async(tensor, name, ps).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        name = _grad_name(ctx.name)
        ps = ctx.ps
        summed = T.allreduce_async(grad.contiguous(), name, ReduceOp.Average,
                                   process_set=ps).wait()
        rows = 1 if len(ctx.shape) == 0 else ctx.shape[0]
        dims_name = None if name is None else f"{name}.dims"
        dims = C.allgather(torch.tensor([rows]).numpy(), dims_name, process_set=ps)
        me = C.rank() if ps is C.global_process_set else ps.rank()
        start = int(dims[:me].sum())
        return summed[start : start + rows].reshape(ctx.shape), None, None


class BroadcastFn(torch.autograd.Function):
    """broadcast; backward: the root gets the average of the ranks' gradients, others zeros."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, ps: Any):
        ctx.args = (root_rank, name, ps)
        return T.broadcast_async(tensor, root_rank, name, ps).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        root_rank, name, ps = ctx.args
        summed = T.allreduce_async(grad.contiguous(), _grad_name(name), ReduceOp.Average,
                                   process_set=ps).wait()
        if C.rank() != root_rank:
            summed = torch.zeros_like(summed)
        return summed, None, None, None


class AlltoallFn(torch.autograd.Function):
    """alltoall; backward: send each gradient block back where its rows came from."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, ps: Any):
        out, received = T.alltoall_async(tensor, splits, name, ps).wait()
        ctx.received = received
        ctx.name, ctx.ps = name, ps
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> tuple:
        out, _ = T.alltoall_async(grad.contiguous(), ctx.received, _grad_name(ctx.name),
                                  ctx.ps).wait()
        return out, None, None, None


class ReducescatterFn(torch.autograd.Function):
    """reducescatter; backward: gather the row-block gradients (times size for Sum, as Horovod)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp,
                prescale: float, postscale: float, ps: Any) -> torch.Tensor:
        ctx.args = (name, op, prescale * postscale, ps)
        return T.reducescatter_async(tensor, name, op, prescale, postscale, ps).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        name, op, scale, ps = ctx.args
        gathered = T.allgather_async(grad.contiguous(), _grad_name(name), ps).wait()
        if op == ReduceOp.Sum:  # as Horovod: Sum scales by the size, Average passes through
            scale *= C.size() if ps is C.global_process_set else ps.size()
        if scale != 1.0:
            gathered = gathered * scale
        return gathered, None, None, None, None, None
