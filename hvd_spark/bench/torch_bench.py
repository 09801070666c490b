"""Training throughput: hvd_spark.torch.DistributedOptimizer vs torch DDP on Gloo.

``python -m hvd_spark.bench torch [--np 2] [--steps 10] [--warmup 3] [--batch 32]
[--models conv,mlp] [--threads 1]`` launches local ranks with ``run_local``; in the
same processes and the same run, each model trains with both hvd_spark and
``DistributedDataParallel`` (Gloo over TCP on 127.0.0.1), same model, batch and
optimizer. Torch threads per rank default to 1 so that ranks do not fight over
the cores of a small machine.
"""

from __future__ import annotations

import argparse
import socket
import time
import warnings
from collections.abc import Sequence
from typing import Any

MODES = ("hvd_spark", "ddp")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hvd_spark.bench torch", description=__doc__)
    p.add_argument("--np", type=int, default=2, help="number of local ranks")
    p.add_argument("--steps", type=int, default=20, help="timed steps per model and mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--models", default="conv,mlp", help="comma-separated: conv, mlp")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda: every rank on GPU local_rank %% count (DDP on Gloo "
                        "then reduces CUDA tensors too)")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternate the two modes this many times; the best round counts")
    return p.parse_args(argv)


def _build(kind: str) -> tuple[Any, Any]:
    """The model and one batch-shaped input factory for ``kind``."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "mlp":  # 1024*4096 + 4096*4096 + 4096*1024 + ... ~= 25.2M parameters
        model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                              nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 10))
        return model, lambda b: torch.randn(b, 1024)

    class Residual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.relu(self.body(x) + self.skip(x))

    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        Residual(16, 16, 1), Residual(16, 32, 2), Residual(32, 64, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    return model, lambda b: torch.randn(b, 3, 32, 32)


def _time_mode(kind: str, mode: str, cfg: argparse.Namespace) -> float:
    """Seconds for ``cfg.steps`` training steps of ``kind`` with ``mode`` (max over ranks)."""
    import torch
    import torch.distributed as dist

    import hvd_spark.torch as hvd

    device = _device(cfg.device, hvd.local_rank())
    model, make_input = _build(kind)
    model = model.to(device)
    x, y = make_input(cfg.batch).to(device), torch.randint(0, 10, (cfg.batch,)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if mode == "ddp":
        # broadcast_buffers=False: hvd_spark does not sync BN buffers each step either.
        with warnings.catch_warnings():  # torch 2.13 deprecates the flag but keeps it working
            warnings.simplefilter("ignore", FutureWarning)
            net = torch.nn.parallel.DistributedDataParallel(
                model, broadcast_buffers=False,
                device_ids=[device.index] if device.type == "cuda" else None)
        sync = _synced(dist.barrier, device)
    else:
        net = model
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, model.named_parameters())
        sync = _synced(hvd.barrier, device)
    loss_fn = torch.nn.CrossEntropyLoss()
    start = 0.0
    for step in range(cfg.warmup + cfg.steps):
        if step == cfg.warmup:
            sync()
            start = time.perf_counter()
        loss_fn(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    sync()
    elapsed = time.perf_counter() - start
    if mode != "ddp":
        opt.remove_hooks()
    return max(hvd.allgather_object(elapsed))


def _device(name: str, local_rank: int) -> Any:
    import torch

    if name == "cpu":
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _synced(barrier: Any, device: Any) -> Any:
    """``barrier`` after the device has finished its queued work (CUDA runs async)."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        barrier()

    return sync


def _worker(cfg: argparse.Namespace, port: int) -> dict:
    import torch
    import torch.distributed as dist

    import hvd_spark.torch as hvd

    torch.set_num_threads(cfg.threads)
    hvd.init()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=hvd.rank(), world_size=hvd.size())
    best: dict = {}
    try:
        for kind in cfg.models.split(","):
            for rnd in range(cfg.rounds):
                for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
                    secs = _time_mode(kind, mode, cfg)
                    best[(kind, mode)] = min(secs, best.get((kind, mode), float("inf")))
    finally:
        dist.destroy_process_group()
    return best


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _params(kind: str) -> int:
    return sum(p.numel() for p in _build(kind)[0].parameters())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print one row per model; returns the exit code."""
    from hvd_spark.runner.local.local_launcher import run_local

    cfg = _parse(argv)
    best = run_local(_worker, args=(cfg, _free_port()), num_proc=cfg.np)[0]
    print(f"torch DistributedOptimizer vs DDP(gloo): {cfg.np} ranks on {cfg.device}, batch "
          f"{cfg.batch}/rank, {cfg.steps} timed steps (best of {cfg.rounds}), torch threads/rank "
          f"{cfg.threads}")
    header = (f"{'model':<6} {'params':>10} {'hvd_spark samples/s':>20} "
              f"{'ddp samples/s':>14} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    for kind in cfg.models.split(","):
        rates = {m: cfg.steps * cfg.batch * cfg.np / best[(kind, m)] for m in MODES}
        print(f"{kind:<6} {_params(kind):>10,} {rates['hvd_spark']:>20.1f} {rates['ddp']:>14.1f} "
              f"{rates['hvd_spark'] / rates['ddp']:>5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
