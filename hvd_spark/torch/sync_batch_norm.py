"""Batch normalization whose training statistics cover the whole global batch.

Forward sums (count, sum, sum of squares) per channel over all ranks in one
allreduce; backward sums the two per-channel gradient reductions the same way.
Weight and bias gradients stay local: DistributedOptimizer averages them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from hvd_spark import collectives as C
from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.torch import tensor_ops as T


def _per_channel(t: torch.Tensor) -> torch.Tensor:
    """(N, C, ...) -> (C, N*...) so reductions over dim 1 are per channel."""
    return t.transpose(0, 1).reshape(t.shape[1], -1)


def _bcast(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.reshape((1, -1) + (1,) * (like.dim() - 2))


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    return T.allreduce_async(t.contiguous(), None, ReduceOp.Sum).wait()


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, momentum: float) -> torch.Tensor:
        # Statistics in float64: sum-of-squares variance loses digits in float32.
        flat = _per_channel(x.detach()).double()
        local = torch.cat([torch.tensor([flat.shape[1]], dtype=torch.float64),
                           flat.sum(1), (flat * flat).sum(1)])
        total = _sum_over_ranks(local)
        channels = x.shape[1]
        count = total[0]
        mean = total[1 : 1 + channels] / count
        var = (total[1 + channels :] / count - mean * mean).clamp_min(0.0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            unbiased = var * (count / max(float(count) - 1.0, 1.0))
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        mean, invstd = mean.to(x.dtype), invstd.to(x.dtype)
        xhat = (x - _bcast(mean, x)) * _bcast(invstd, x)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.count = float(count)
        out = xhat
        if weight is not None:
            out = out * _bcast(weight, x)
        if bias is not None:
            out = out + _bcast(bias, x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        xhat, weight, invstd = ctx.saved_tensors
        sum_dy = _per_channel(grad).sum(1)
        sum_dy_xhat = _per_channel(grad * xhat).sum(1)
        total = _sum_over_ranks(torch.cat([sum_dy, sum_dy_xhat]))
        channels = grad.shape[1]
        mean_dy = total[:channels] / ctx.count
        mean_dy_xhat = total[channels:] / ctx.count
        scale = invstd if weight is None else invstd * weight
        grad_x = _bcast(scale, grad) * (grad - _bcast(mean_dy, grad)
                                        - xhat * _bcast(mean_dy_xhat, grad))
        grad_w = sum_dy_xhat if weight is not None else None
        grad_b = sum_dy if weight is not None else None
        return grad_x, grad_w, grad_b, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` normalizing over all ranks' batches.

    In eval mode (or with one rank) it is an ordinary batch norm. Every rank must
    call forward the same number of times, since each call is a collective.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects (N, C, ...) input, got {x.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training or not C.is_initialized() or C.size() == 1:
            return super().forward(x)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        running = self.track_running_stats
        return _SyncBatchNormFn.apply(
            x, self.weight, self.bias, self.running_mean if running else None,
            self.running_var if running else None, self.eps, momentum)
