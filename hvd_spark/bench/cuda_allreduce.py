"""Allreduce of CUDA buffers: hvd_spark's device path vs host staging vs torch.distributed.

``python -m hvd_spark.bench allreduce --device cuda [-np N]``. Every size is timed, in
the same processes and alternately: hvd_spark's device path (CUDA IPC when ranks share
a GPU, NCCL with one rank per GPU), the same allreduce staged through host memory (what
CUDA tensors cost without a device path), and torch.distributed on CUDA tensors (NCCL
with one rank per GPU, Gloo when ranks share one: NCCL refuses that). busbw as in
nccl-tests: 2(N-1)/N x bytes / time.
"""

from __future__ import annotations

import socket
import sys
import time

import numpy as np

from hvd_spark.bench.timing import DEFAULT_SIZES, busbw, human_size, iterations, parse_size


def _torch_dist(hvd, backend: str):
    import torch.distributed as dist

    port = None
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = hvd.broadcast_object(port, 0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}",
                            rank=hvd.rank(), world_size=hvd.size())
    return dist


def rank_main(opts: dict) -> dict | None:
    """Measure on this rank (its GPU: local rank modulo the GPUs); rank 0 returns rows."""
    import cupy
    import torch

    import hvd_spark.collectives as hvd
    from hvd_spark.collectives import _plumbing, device_ops, ops

    hvd.init()
    n, gpus = hvd.size(), cupy.cuda.runtime.getDeviceCount()
    device = hvd.local_rank() % gpus
    cupy.cuda.Device(device).use()
    torch.cuda.set_device(device)
    shared = hvd.local_size() > gpus
    dist = _torch_dist(hvd, "gloo" if shared else "nccl")
    stream = cupy.cuda.get_current_stream()

    def reduce_max(seconds: float) -> float:
        return float(hvd.allreduce(np.array([seconds]), name="bench.t", op=ops.Max)[0])

    def timed(fn, iters: int) -> float:
        for _ in range(2):
            fn()
        stream.synchronize()
        torch.cuda.synchronize()
        hvd.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        stream.synchronize()
        torch.cuda.synchronize()
        return reduce_max((time.perf_counter() - start) / iters)

    rows = []
    for nbytes in opts["sizes"]:
        count = nbytes // 4
        x = cupy.zeros(count, cupy.float32)  # zeros: repeated sums never overflow
        t = torch.zeros(count, dtype=torch.float32, device=f"cuda:{device}")

        def device_path(x=x):
            device_ops.allreduce_many_async_([x], ["bench.d"], ops.Sum)[0].wait()

        def staged(x=x):
            host = cupy.asnumpy(x)
            hvd.allreduce_(host, name="bench.s", op=ops.Sum)
            x.set(host)

        def torch_dist(t=t):
            dist.all_reduce(t)

        iters = iterations(nbytes, opts["budget"])
        row = {"bytes": count * 4, "iters": iters}
        for _ in range(2):  # alternate: a noisy moment hits every peer alike
            for key, fn in (("device", device_path), ("staged", staged), ("torch", torch_dist)):
                row[key] = min(row.get(key, float("inf")), timed(fn, iters))
        rows.append(row)
    plan = _plumbing.current_engine().comm.plan
    mode = plan.mode if plan else "none"
    dist.destroy_process_group()
    hvd.shutdown()
    torch_name = "torch gloo" if shared else "torch nccl"
    return {"size": n, "gpus": gpus, "mode": mode, "torch": torch_name,
            "rows": rows} if hvd.rank() == 0 else None


def format_table(result: dict) -> str:
    """The nccl-tests-like table, busbw in GB/s, with ratios to the peers."""
    n = result["size"]
    lines = [f"CUDA allreduce: {n} ranks on {result['gpus']} GPU(s), float32 Sum in place; "
             f"hvd_spark device path = {result['mode']}; peer = {result['torch']}",
             f"{'size':>8} {'device GB/s':>11} {'staged GB/s':>11} {'x staged':>8} "
             f"{'peer GB/s':>9} {'x peer':>6}"]
    for row in result["rows"]:
        b = row["bytes"]
        dev, stg, peer = (busbw(b, row[k], n) for k in ("device", "staged", "torch"))
        lines.append(f"{human_size(b):>8} {dev:11.2f} {stg:11.2f} {dev / stg:8.2f} {peer:9.2f} "
                     f"{dev / peer:6.2f}")
    return "\n".join(lines)


def run(args) -> int:
    """``allreduce --device cuda``: launch the ranks (or run inside hvdrun), print the table."""
    import os

    from hvd_spark.collectives.nccl import library

    if library.device_count() == 0:
        print("allreduce --device cuda needs a CUDA GPU and cupy (the gpu extra: cupy-cuda12x, "
              "nvidia-nccl-cu12); none here", file=sys.stderr)
        return 2

    sizes = "1M,16M,64M,256M" if args.sizes == DEFAULT_SIZES else args.sizes
    opts = {"sizes": [parse_size(s) for s in sizes.split(",")], "budget": args.budget_mb * 1e6}
    if "HVD_SPARK_RANK" in os.environ:
        result = rank_main(opts)
        if result is None:
            return 0
    else:
        from hvd_spark.runner import run_local

        result = run_local(rank_main, args=(opts,), num_proc=args.num_proc)[0]
    print(format_table(result))
    return 0
