"""Rank functions for the torch.distributed tests: plain PyTorch code, as users bring it.

None of them imports hvd_spark: each calls ``torch.distributed.init_process_group`` with
no arguments, which works only because the launcher gave the rank torchrun's
environment. Data: 64 rows of 8 features; at step k the global batch is rows
``[16k, 16k+16)`` and rank r of N takes its ``16/N`` rows of it.
"""

from __future__ import annotations

import os
import signal

GLOBAL_BATCH = 16
STEPS = 4
LR = 0.1


def _data():
    import torch

    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(64, 1, generator=g)


def model():
    """The net every test trains, with its initial weights fixed by the seed."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _rows(step: int, rank: int, size: int) -> slice:
    per = GLOBAL_BATCH // size
    start = step * GLOBAL_BATCH + rank * per
    return slice(start, start + per)


def _train(net, rank: int, size: int, hook=None) -> None:
    import torch

    x, y = _data()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        rows = _rows(step, rank, size)
        loss = torch.nn.functional.mse_loss(net(x[rows]), y[rows])
        if hook is not None:
            hook(step)
        loss.backward()
        opt.step()


def reference() -> dict:
    """One process at the global batch: the weights every distributed run must reach."""
    net = model()
    _train(net, 0, 1)
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def ddp() -> dict:
    """DDP over gloo; returns the env it found and the final weights."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        net = torch.nn.parallel.DistributedDataParallel(model())
        _train(net, dist.get_rank(), dist.get_world_size())
        weights = {k: v.detach().numpy().copy() for k, v in net.module.state_dict().items()}
        return {"weights": weights, "rank": dist.get_rank(),
                "master": (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])}
    finally:
        dist.destroy_process_group()


def fsdp2(checkpoint_dir: str | None = None) -> dict:
    """FSDP2 (``fully_shard``) on CPU; optionally a sharded ``torch.distributed.checkpoint``
    save of the trained model to ``checkpoint_dir``. Returns the full weights."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    try:
        net = model()
        for layer in (net[0], net[2]):
            fully_shard(layer)
        fully_shard(net)
        _train(net, dist.get_rank(), dist.get_world_size())
        if checkpoint_dir is not None:
            dcp.save({"model": get_model_state_dict(net)}, checkpoint_id=checkpoint_dir)
        return {k: v.full_tensor().detach().numpy().copy() for k, v in net.state_dict().items()}
    finally:
        dist.destroy_process_group()


def dcp_resume(checkpoint_dir: str) -> dict:
    """Load the sharded checkpoint into a fresh model, sharded over however many ranks
    this job has (1 or 2); returns the full weights."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    try:
        net = model()
        for p in net.parameters():
            p.data.zero_()  # nothing of the seed's weights may survive the load
        if dist.get_world_size() > 1:
            for layer in (net[0], net[2]):
                fully_shard(layer)
            fully_shard(net)
        state = {"model": get_model_state_dict(net)}
        dcp.load(state, checkpoint_id=checkpoint_dir)
        set_model_state_dict(net, state["model"])
        out = {}
        for k, v in net.state_dict().items():
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[k] = full.detach().numpy().copy()
        return out
    finally:
        dist.destroy_process_group()


def ddp_with_fault(victim: int, step: int, sig: int = signal.SIGKILL) -> None:
    """DDP where rank ``victim`` sends itself ``sig`` inside backward at ``step``: its peers
    are then waiting in gloo's all-reduce of that step's gradients."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    net = torch.nn.parallel.DistributedDataParallel(model())
    rank = dist.get_rank()
    current = {"step": -1}

    def on_grad(grad):
        if rank == victim and current["step"] == step:
            print(f"rank {rank}: fault {sig} now", flush=True)
            os.kill(os.getpid(), sig)
        return grad

    net.module[0].weight.register_hook(on_grad)

    def mark(k: int) -> None:
        current["step"] = k

    for epoch in range(step // STEPS + 2):  # the fault ends the job before this loop does
        _train(net, rank, dist.get_world_size(), hook=lambda k, e=epoch: mark(k + e * STEPS))
    raise AssertionError(f"rank {victim} was to fault at step {step}, and the job went on")
