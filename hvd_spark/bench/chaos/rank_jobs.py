"""What the chaos soak's ranks run: a model that reports its steps, an elastic loop and a
DDP loop. Each appends ``<time> <event> [<n>]`` lines to a progress file on a path all
hosts share, which the driver tails (``events.ProgressTail``): ``step N`` from rank 0
after each training step, ``reset`` from every rank after an elastic reset.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from hvd_spark import _env


def report(path: str, event: str) -> None:
    """Append one progress line (a single short write: whole under O_APPEND)."""
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{time.time():.3f} {event}\n".encode())
    finally:
        os.close(fd)


class ChaosNet(torch.nn.Module):
    """A small regression net that counts its training steps in a buffer (so the count is
    checkpointed and resumes with the weights) and reports them from rank 0.

    Args:
        progress: The progress file ('' reports nothing).
        pause_s: Sleep per training step, so faults land mid-training.
    """

    def __init__(self, progress: str = "", pause_s: float = 0.05) -> None:
        super().__init__()
        self.progress = progress
        self.pause_s = pause_s
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
            time.sleep(self.pause_s)
            if os.environ.get(_env.RANK) == "0":
                report(self.progress, f"step {int(self.steps)}")
        return self.net(x)


def elastic_loop(steps: int, commit_every: int, progress: str, pause_s: float
                 ) -> tuple[int, int, int, list[float]]:
    """Average a rank-dependent vector into the state every step until ``steps``.

    Returns:
        ``(rank, size, step, weights)``: equal weights on every rank mean the state
        stayed consistent through every reset.
    """
    import numpy as np

    import hvd_spark.collectives as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(step=0, weights=np.zeros(8))
    state.register_reset_callbacks([lambda: report(progress, f"reset {hvd.rank()}")])

    @hvd.elastic.run
    def loop(state: Any) -> tuple[int, int, int, list[float]]:
        while state.step < steps:
            grad = np.sin(np.arange(8.0) + state.step + hvd.rank())
            state.weights = state.weights + hvd.allreduce(grad, op=hvd.Average,
                                                          name="grad")
            state.step += 1
            if hvd.rank() == 0:
                report(progress, f"step {state.step}")
            if state.step % commit_every == 0:
                state.commit()
            time.sleep(pause_s)
        return hvd.rank(), hvd.size(), state.step, [float(w) for w in state.weights]

    return loop(state)


def ddp_loop(steps: int, progress: str, pause_s: float) -> int:
    """torch.distributed DDP over gloo for ``steps`` steps (as TorchDistributor runs it)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        net = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        x, y = torch.randn(32, 3), torch.randn(32, 1)
        for step in range(1, steps + 1):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            if dist.get_rank() == 0:
                report(progress, f"step {step}")
            time.sleep(pause_s)
        return steps
    finally:
        dist.destroy_process_group()
