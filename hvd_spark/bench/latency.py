"""Small-message latency: the MPI backend vs the TCP/shared-memory backend.

``python -m hvd_spark.bench latency [-np 2] [--sizes 1K,4K,64K] [--rounds 3]
[--op allreduce|broadcast|allgather]
[--frameworks out_of_place,torch,tf,tf_function,tf_floor,tf_py_floor]`` alternates,
round by round, a job under ``hvdrun`` (TCP backend, shared memory between local ranks)
and one under ``hvdrun --mpi``; inside the MPI job, raw ``MPI_Allreduce`` (or
``MPI_Bcast``, ``MPI_Allgather``: mpi4py) is timed in the same processes, alternating
with ours, as the floor. Each figure is the median over rounds of the slowest rank's
mean time per synchronous, end-to-end call (submission, negotiation, the collective,
result). ``--frameworks`` times allreduce only.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time

import numpy as np

from hvd_spark.bench.timing import parse_size

_MARK = "LATENCY_JSON "
# Timed besides numpy in place: numpy out of place (``allreduce(x)``: a fresh output per
# call), torch, TensorFlow eager, TensorFlow inside tf.function, and a tf.function that
# computes ``v + 1`` with no collective at all (TensorFlow's own cost of calling one), and
# one whose only node is an empty ``numpy_function`` (the round trip into Python that a
# collective inside a tf.function makes: the floor ``tf_function`` is measured against).
_FRAMEWORKS = ("out_of_place", "torch", "tf", "tf_function", "tf_floor", "tf_py_floor")


def _mean_time(fn, iters: int) -> float:
    gc.collect()  # a full collection falls outside the timing (see bench.allreduce)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _framework_call(framework: str, count: int):
    """A synchronous 1-tensor Sum allreduce through ``framework``'s binding."""
    if framework == "out_of_place":
        import hvd_spark.collectives as hvd

        x = np.ones(count, np.float32)
        return lambda: hvd.allreduce(x, op=hvd.Sum)
    if framework == "torch":
        import torch

        import hvd_spark.torch as th

        t = torch.ones(count)
        return lambda: th.allreduce_(t, op=th.Sum)
    import tensorflow as tf

    import hvd_spark.tensorflow as tfh

    t = tf.ones([count])
    if framework == "tf":
        return lambda: tfh.allreduce(t, op=tfh.Sum)
    if framework == "tf_floor":
        plus_one = tf.function(lambda v: v + 1)
        return lambda: plus_one(t)
    if framework == "tf_py_floor":
        identity = tf.function(lambda v: tf.numpy_function(lambda x: x, [v], tf.float32,
                                                            stateful=True))
        return lambda: identity(t)
    graph = tf.function(lambda v: tfh.allreduce(v, op=tfh.Sum))
    return lambda: graph(t)


_OPS = ("allreduce", "broadcast", "allgather")


def _op_calls(op: str, x: np.ndarray, raw) -> tuple:
    """(ours, raw MPI's or None): one synchronous ``op`` of ``x`` each, in place where
    the op has an in-place form (allgather makes a new array on both)."""
    import hvd_spark.collectives as hvd

    if op == "broadcast":
        return (lambda: hvd.broadcast_(x, 0, name="bcast"),
                (lambda: raw.Bcast(x, root=0)) if raw else None)
    if op == "allgather":
        gathered = np.empty(x.size * hvd.size(), x.dtype)
        return (lambda: hvd.allgather(x, name="gather"),
                (lambda: raw.Allgather(x, gathered)) if raw else None)
    ours = lambda: hvd.allreduce_(x, op=hvd.Sum)  # noqa: E731
    if raw is None:
        return ours, None
    from mpi4py import MPI  # (imported only where raw is an MPI communicator)

    return ours, lambda: raw.Allreduce(MPI.IN_PLACE, x, MPI.SUM)


def worker(sizes: list[int], iters: int, frameworks: list[str], op: str = "allreduce") -> None:
    """Run inside each rank: time hvd_spark's ``op`` (and raw MPI's, under MPI)."""
    import hvd_spark.collectives as hvd
    from hvd_spark.collectives import ops

    hvd.init()
    backend = hvd.backend_name()
    raw = None
    if backend == "mpi":
        from mpi4py import MPI

        raw = MPI.COMM_WORLD
    rows = []
    for nbytes in sizes:
        x = np.ones(max(1, nbytes // 4), np.float32)
        ours, floor = _op_calls(op, x, raw)
        bindings = {f: _framework_call(f, x.size) for f in frameworks}
        ours_t, floor_t = [], []
        for _ in range(3):  # alternate, so a noisy moment hits both alike
            for fn, out in ((ours, ours_t), (floor, floor_t)):
                if fn is None:
                    continue
                for _ in range(20):
                    fn()
                hvd.barrier()
                seconds = _mean_time(fn, iters)
                out.append(float(hvd.allreduce(np.array([seconds]), op=ops.Max)[0]))
        row = {"bytes": nbytes, "ours": min(ours_t), "raw_mpi": min(floor_t) if floor_t else None}
        for framework, fn in bindings.items():
            for _ in range(20):
                fn()
            hvd.barrier()
            seconds = _mean_time(fn, max(50, iters // 2))
            row[framework] = float(hvd.allreduce(np.array([seconds]), op=ops.Max)[0])
        rows.append(row)
    if hvd.rank() == 0:
        print(_MARK + json.dumps({"backend": backend, "op": op, "rows": rows}), flush=True)
    hvd.shutdown()


def _job(mpi: bool, num_proc: int, argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "hvd_spark.runner", *(["--mpi"] if mpi else []),
           "-np", str(num_proc), sys.executable, "-m", "hvd_spark.bench.latency", "--worker",
           *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if _MARK in line:
            return json.loads(line.split(_MARK, 1)[1])
    raise RuntimeError(f"latency job ({'mpi' if mpi else 'tcp'}) failed: "
                       f"{(proc.stdout + proc.stderr)[-2000:]}")


def format_table(num_proc: int, runs: dict[str, list[dict]]) -> str:
    """One line per size: medians over rounds, in microseconds."""
    def med(backend: str, i: int, key: str) -> float:
        values = [r["rows"][i][key] for r in runs[backend] if r["rows"][i][key] is not None]
        return statistics.median(values) * 1e6 if values else float("nan")

    frameworks = [k for k in runs["tcp"][0]["rows"][0] if k in _FRAMEWORKS]
    op = runs["tcp"][0].get("op", "allreduce")
    what = "float32 Sum" if op == "allreduce" else "float32, per rank"
    lines = [f"{op} latency, {num_proc} ranks, {what}, us per call (median of "
             f"{len(runs['tcp'])} rounds; frameworks on tcp+shm)",
             f"{'size':>8} {'tcp+shm':>9} {'mpi':>9} {'raw MPI':>9} {'mpi/tcp':>8}"
             + "".join(f" {f:>8}" for f in frameworks)]
    for i, row in enumerate(runs["tcp"][0]["rows"]):
        tcp, mpi, raw = med("tcp", i, "ours"), med("mpi", i, "ours"), med("mpi", i, "raw_mpi")
        lines.append(f"{row['bytes']:>8} {tcp:9.1f} {mpi:9.1f} {raw:9.1f} {mpi / tcp:8.2f}"
                     + "".join(f" {med('tcp', i, f):8.1f}" for f in frameworks))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hvd_spark.bench latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-np", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--sizes", default="1K,4K,64K", help="message sizes (default 1K,4K,64K)")
    p.add_argument("--iters", type=int, default=500, help="calls timed per sample")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of both jobs")
    p.add_argument("--op", default="allreduce", choices=_OPS,
                   help="the collective timed (default allreduce)")
    p.add_argument("--frameworks", default="",
                   help=f"also time these bindings' allreduce on tcp+shm: "
                        f"{','.join(_FRAMEWORKS)}")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend-worker", default="tcp", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    frameworks = [f for f in args.frameworks.split(",") if f]
    unknown = sorted(set(frameworks) - set(_FRAMEWORKS))
    if unknown:
        p.error(f"--frameworks: unknown {unknown}; choose from {','.join(_FRAMEWORKS)}")
    if frameworks and args.op != "allreduce":
        p.error("--frameworks times allreduce: leave out --op, or --frameworks")
    if args.worker:
        worker(sizes, args.iters, frameworks if args.backend_worker == "tcp" else [], args.op)
        return 0
    worker_argv = ["--sizes", args.sizes, "--iters", str(args.iters),
                   "--frameworks", ",".join(frameworks), "--op", args.op]
    runs: dict[str, list[dict]] = {"tcp": [], "mpi": []}
    for _ in range(args.rounds):
        runs["tcp"].append(_job(False, args.np, worker_argv))
        runs["mpi"].append(_job(True, args.np, [*worker_argv, "--backend-worker", "mpi"]))
    print(format_table(args.np, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
