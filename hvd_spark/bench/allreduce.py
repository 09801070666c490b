"""Allreduce bandwidth, nccl-tests style: hvd_spark vs torch Gloo and MPI, in one run.

``python -m hvd_spark.bench allreduce [-np N]`` launches N local ranks itself (or run
it under ``hvdrun -np N``). Every size is timed for hvd_spark and Gloo alternately in
the same processes; MPI Allreduce (mpi4py, Open MPI) runs right after under mpirun.
busbw = 2(N-1)/N x bytes / time, so it is comparable across N.

The limit column is this machine's memory bound for the work, measured in the same
processes right after each size: every rank at once runs a STREAM-style add over a
message-sized buffer (read two buffers, write one: ``np.add(a, b, out=c)``), and the
limit is the busbw an allreduce would reach if it cost exactly that one add. ``x limit``
is our fraction of it. It is a yardstick, not a ceiling: a 2-rank allreduce over shared
memory reduces half the message per rank (read 2 halves, write 1) and copies in the other
half (read 1, write 1), 2.5 message sizes of memory traffic against the add's 3, so
``x limit`` can reach about 1.2 where memory is the bound (messages past the caches);
within the caches the add is so cheap that the fixed cost of a collective dominates.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys

import numpy as np

from hvd_spark.bench.mpi_peer import run_mpi
from hvd_spark.bench.timing import (
    DEFAULT_SIZES,
    busbw,
    human_size,
    iterations,
    parse_size,
    time_loop,
)


def resnet50_shapes() -> list[tuple[int, ...]]:
    """The 161 parameter shapes of torchvision's ResNet-50 (25.6M floats, 102 MB)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    channels = 64
    for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        for block in range(blocks):
            shapes += [(width, channels, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if block == 0:
                shapes += [(4 * width, channels, 1, 1), (4 * width,), (4 * width,)]
            channels = 4 * width
    return shapes + [(1000, 2048), (1000,)]


def _gloo_setup(hvd):
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    torch.set_num_threads(1)
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    else:
        port = None
    port = hvd.broadcast_object(port, 0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=hvd.rank(), world_size=hvd.size())
    return torch, dist


def rank_main(opts: dict) -> dict | None:
    """Measure on this rank; rank 0 returns the rows."""
    import hvd_spark.collectives as hvd

    hvd.init()
    n = hvd.size()
    gloo = _gloo_setup(hvd) if "gloo" in opts["peers"] else None

    def reduce_max(seconds: float) -> float:
        return float(hvd.allreduce(np.array([seconds]), name="bench.t", op=hvd.Max)[0])

    rows = []
    for nbytes in opts["sizes"]:
        count = nbytes // 4
        arr = np.zeros(count, np.float32)  # zeros: repeated sums never overflow
        iters = iterations(nbytes, opts["budget"])
        row = {"bytes": count * 4, "count": count, "iters": iters}
        row["hvd"] = time_loop(
            lambda arr=arr: hvd.allreduce_(arr, name="bench.a", op=hvd.Sum),
            iters, hvd.barrier, reduce_max)
        row["limit"] = _stream_add(count, iters, hvd.barrier, reduce_max)
        if gloo is not None:
            torch, dist = gloo
            tensor = torch.zeros(count, dtype=torch.float32)
            row["gloo"] = time_loop(
                lambda t=tensor, d=dist: d.all_reduce(t), iters, dist.barrier, reduce_max)
        rows.append(row)
    resnet = _resnet_case(hvd, gloo, reduce_max) if opts["resnet"] else None
    if gloo is not None:
        gloo[1].destroy_process_group()
    return {"size": n, "rows": rows, "resnet": resnet} if hvd.rank() == 0 else None


def _stream_add(count: int, iters: int, barrier, reduce_max) -> float:
    """Seconds per STREAM-style add of ``count`` float32 on every rank at once (slowest)."""
    a, b = np.ones(count, np.float32), np.ones(count, np.float32)
    c = np.empty(count, np.float32)
    return time_loop(lambda: np.add(a, b, out=c), iters, barrier, reduce_max)


def _resnet_case(hvd, gloo, reduce_max) -> dict:
    shapes = resnet50_shapes()
    grads = [np.zeros(s, np.float32) for s in shapes]
    total = sum(g.size for g in grads)
    flat = np.zeros(total, np.float32)
    out = {"tensors": len(grads), "bytes": total * 4}

    def grouped():
        hvd.grouped_allreduce_(grads, name="bench.resnet", op=hvd.Sum)

    def flat_one():
        hvd.allreduce_(flat, name="bench.flat", op=hvd.Sum)

    def each():  # what per-parameter gradient hooks do: one async call per tensor
        handles = [hvd.allreduce_async_(g, name=f"bench.each.{i}", op=hvd.Sum)
                   for i, g in enumerate(grads)]
        for handle in handles:
            hvd.synchronize(handle)

    # Their ratio is a target: alternate short blocks of each, take each one's median
    # (one block of each swung the ratio from 0.8 to 1.7 on this shared machine).
    paths = {"hvd_grouped": grouped, "hvd_flat": flat_one, "hvd_each": each}
    torch_grouped = _torch_grouped(shapes)
    if torch_grouped is not None:
        paths["torch_grouped"] = torch_grouped
    blocks: dict[str, list[float]] = {key: [] for key in paths}
    for _ in range(5):
        for key, path in paths.items():
            blocks[key].append(time_loop(path, 3, hvd.barrier, reduce_max))
    out.update({k: statistics.median(v) for k, v in blocks.items()})
    if gloo is not None:
        torch, dist = gloo
        tgrads = [torch.zeros(s) for s in shapes]
        tflat = torch.zeros(total)

        def one_by_one():
            for t in tgrads:
                dist.all_reduce(t)

        out["gloo_each"] = time_loop(one_by_one, 3, dist.barrier, reduce_max)
        out["gloo_flat"] = time_loop(lambda: dist.all_reduce(tflat), 5, dist.barrier, reduce_max)
    return out


def _torch_grouped(shapes):
    """``hvd_spark.torch.grouped_allreduce_`` of CPU tensors (None without torch)."""
    try:
        import torch

        import hvd_spark.torch as hvd_torch
    except ImportError:
        return None
    tensors = [torch.zeros(s) for s in shapes]
    return lambda: hvd_torch.grouped_allreduce_(tensors, name="bench.torch", op=hvd_torch.Sum)


def format_table(result: dict, mpi_rows: list[dict], mpi_desc: str) -> str:
    """Render the nccl-tests-like table with ratios against each peer."""
    n = result["size"]
    mpi = {r["bytes"]: r["mpi"] for r in mpi_rows}
    head = (f"{'size':>8} {'count':>10} {'time(us)':>10} {'algbw':>7} {'busbw':>7} |"
            f" {'limit':>7} {'x limit':>7} |"
            f" {'gloo busbw':>10} {'x gloo':>7} | {'mpi busbw':>9} {'x mpi':>6}")
    lines = [f"hvd_spark allreduce: {n} ranks, float32 Sum in place, GB/s; {mpi_desc}",
             "limit: busbw at the cost of one STREAM add (a+b->c) per rank, all ranks at once",
             head]
    for row in result["rows"]:
        b, t = row["bytes"], row["hvd"]
        bus = busbw(b, t, n)
        gloo = row.get("gloo")
        gbus = busbw(b, gloo, n) if gloo else math.nan
        mbus = busbw(b, mpi[b], n) if b in mpi else math.nan
        limit = busbw(b, row["limit"], n) if "limit" in row else math.nan
        lines.append(
            f"{human_size(b):>8} {row['count']:>10} {t * 1e6:>10.1f} {b / t / 1e9:>7.2f}"
            f" {bus:>7.2f} | {limit:>7.2f} {bus / limit:>7.2f} |"
            f" {gbus:>10.2f} {bus / gbus:>7.2f} | {mbus:>9.2f} {bus / mbus:>6.2f}")
    res = result.get("resnet")
    if res:
        lines += ["", f"ResNet-50 gradients: {res['tensors']} tensors, {res['bytes'] / 1e6:.1f} MB"
                  " per step (ms per step, slowest rank; ours: median of 5 alternating blocks)"]
        for key, label in (("hvd_grouped", "hvd_spark grouped (fused) allreduce"),
                           ("hvd_flat", "hvd_spark one flat buffer"),
                           ("hvd_each", "hvd_spark async, one call per tensor"),
                           ("torch_grouped", "hvd_spark.torch grouped_allreduce_"),
                           ("gloo_each", "Gloo one tensor at a time"),
                           ("gloo_flat", "Gloo one flat buffer")):
            if key in res:
                lines.append(f"  {label:38s} {res[key] * 1e3:9.1f} ms")
        if "gloo_each" in res:
            speedup = res["gloo_each"] / res["hvd_grouped"]
            lines.append(f"  speed-up vs Gloo one-by-one: {speedup:.2f}x;"
                         f" grouped / flat (ours): {res['hvd_grouped'] / res['hvd_flat']:.2f}x")
        if "hvd_each" in res:
            lines.append(f"  one call per tensor / flat (ours): "
                         f"{res['hvd_each'] / res['hvd_flat']:.2f}x")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options of the allreduce benchmark."""
    p = argparse.ArgumentParser(prog="python -m hvd_spark.bench allreduce")
    p.add_argument("-np", "--num-proc", type=int, default=2, help="ranks to launch (default 2)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma list (default {DEFAULT_SIZES})")
    p.add_argument("--peers", default="gloo,mpi", help="peers to compare: gloo,mpi or none")
    p.add_argument("--budget-mb", type=float, default=1024, help="bytes reduced per size, MB")
    p.add_argument("--no-resnet", action="store_true", help="skip the ResNet-50 gradient case")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: CUDA buffers, hvd_spark's device path (NCCL / CUDA IPC) vs host "
                        "staging vs torch.distributed")
    hosts = p.add_argument_group("several hosts", "network namespaces as hosts (needs root): "
                                 "hierarchical vs flat vs Gloo on the same shaped links")
    hosts.add_argument("--hosts", type=int, default=None, help="number of namespace hosts")
    hosts.add_argument("--ranks-per-host", type=int, default=2, help="ranks on each host")
    hosts.add_argument("--bandwidth", default=None, help="link rate, e.g. 1gbit or 10gbit")
    hosts.add_argument("--delay", default=None, help="one-way link delay, e.g. 100us (netem)")
    hosts.add_argument("--json", default=None, help="also write the measurements here")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    """Run the benchmark (launching the ranks unless already inside hvdrun)."""
    args = parse_args(argv)
    if args.device == "cuda":
        from hvd_spark.bench import cuda_allreduce

        return cuda_allreduce.run(args)
    if args.hosts is not None:
        from hvd_spark.bench import multihost_allreduce

        if args.sizes == DEFAULT_SIZES:
            args.sizes = multihost_allreduce.HOSTS_SIZES
        return multihost_allreduce.run(args)
    opts = {"sizes": [parse_size(s) for s in args.sizes.split(",")],
            "peers": args.peers.split(","), "budget": args.budget_mb * 1e6,
            "resnet": not args.no_resnet}
    worker_argv = ["--sizes", args.sizes, "--budget-mb", str(args.budget_mb)]
    if "HVD_SPARK_RANK" in os.environ:
        result = rank_main(opts)
        num_proc = int(os.environ["HVD_SPARK_SIZE"])
        if result is None:
            return 0
    else:
        from hvd_spark.runner import run_local

        num_proc = args.num_proc
        result = run_local(rank_main, args=(opts,), num_proc=num_proc)[0]
    mpi_rows, mpi_desc = ([], "MPI: not requested")
    if "mpi" in opts["peers"]:
        mpi_rows, mpi_desc = run_mpi(num_proc, worker_argv)
    print(format_table(result, mpi_rows, mpi_desc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
