"""Training cases shared by the torch correctness tests: the same code runs distributed
(each rank on its half of every batch) and as the single-process reference (full batches)."""

from __future__ import annotations

import torch
from torch import nn

STEPS = 20
BATCH = 16
IN, HIDDEN, OUT = 8, 16, 4


class Routed(nn.Module):
    """head_b sees only some rows: on even steps none of rank 0's rows; ``never`` is unused."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(IN, HIDDEN)
        self.head_a = nn.Linear(HIDDEN, OUT)
        self.head_b = nn.Linear(HIDDEN, OUT)
        self.never = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        out = h.new_zeros(x.shape[0], OUT)
        idx_a, idx_b = (~route).nonzero().flatten(), route.nonzero().flatten()
        out = out.index_put((idx_a,), self.head_a(h[idx_a]))
        if idx_b.numel():
            out = out.index_put((idx_b,), self.head_b(h[idx_b]))
        return out


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "routed":
        return Routed()
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batches():
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, BATCH, IN, generator=g)
    ys = torch.randn(STEPS, BATCH, OUT, generator=g)
    routes = []
    for s in range(STEPS):
        route = torch.zeros(BATCH, dtype=torch.bool)
        start = BATCH // 2 if s % 2 == 0 else 0  # even steps: only rank 1's half routes to b
        route[start + 1 :: 2] = True
        routes.append(route)
    return xs, ys, routes


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(case: dict, distributed: bool) -> dict:
    """Run one case; return the final state_dict as numpy arrays."""
    torch.set_num_threads(1)
    model = make_model(case["model"])
    opt = make_optimizer(case["opt"], model)
    passes = case.get("passes", 1)
    rank, size = 0, 1
    if distributed:
        import hvd_spark.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        compression = getattr(hvd.Compression, case.get("compression", "none"))
        opt = hvd.DistributedOptimizer(opt, model.named_parameters(), compression=compression,
                                       backward_passes_per_step=passes)
    xs, ys, routes = batches()
    shard = BATCH // size
    for s in range(STEPS):
        rows = slice(rank * shard, (rank + 1) * shard)
        x, y, route = xs[s][rows], ys[s][rows], routes[s][rows]
        for xm, ym, rm in zip(x.chunk(passes), y.chunk(passes), route.chunk(passes), strict=True):
            out = model(xm, rm) if case["model"] == "routed" else model(xm)
            loss = nn.functional.mse_loss(out, ym) / passes
            loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


CASES = {
    "sgd_momentum": {"model": "mlp", "opt": "sgd"},
    "adam": {"model": "mlp", "opt": "adam"},
    "sgd_passes2": {"model": "mlp", "opt": "sgd", "passes": 2},
    "adam_passes2": {"model": "mlp", "opt": "adam", "passes": 2},
    "sgd_fp16": {"model": "mlp", "opt": "sgd", "compression": "fp16"},
    "sgd_unused_params": {"model": "routed", "opt": "sgd"},
    "adam_unused_params": {"model": "routed", "opt": "adam"},
}


def train_all_distributed() -> dict:
    return {name: train(case, distributed=True) for name, case in CASES.items()}
