"""Launch overhead of ``hvd_spark.run`` vs Spark's TorchDistributor, and ring formation time.

``python -m hvd_spark.bench spark [--repeats N] [--torch-repeats N] [--skip-torch]
[--ring-procs N] [--skip-ring]``

1. On ``local[2]``: median wall time of warm calls of a trivial function with
   num_proc=2 through a bare barrier job (floor), ``hvd_spark.run``, and
   ``TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run``.
2. On ``local[N]`` (N = --ring-procs, default 4): seconds from the first task starting
   (registering with the driver) until every rank has joined the ring (``init()`` done).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

TARGET_RATIO = 5.0
TARGET_RING_S = 1.5


def _session(master: str, driver_memory: str | None = None):
    """A local Spark session for a benchmark (``driver_memory``: the driver JVM's heap,
    which a local master's executor shares; Spark's default is 1g)."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    active = SparkSession.getActiveSession()
    if active is not None:
        if active.sparkContext.master == master:
            return active
        active.stop()
    builder = SparkSession.builder
    if driver_memory is not None:
        builder = builder.config("spark.driver.memory", driver_memory)
    return (builder.master(master).appName("hvd_spark-bench")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.python.worker.reuse", "true")
            .getOrCreate())


def _median_s(call: Callable[[], object], repeats: int) -> tuple[float, list[float]]:
    call()  # warm-up: Python workers, imports, JIT of the JVM paths
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def _trivial() -> int:
    return 1


def _bare_barrier(spark, num_proc: int) -> None:
    def task(batches):
        import pyarrow as pa

        for _ in batches:
            pass
        yield pa.RecordBatch.from_pydict({"x": pa.array([1], pa.int64())})

    spark.range(num_proc, numPartitions=num_proc).mapInArrow(task, "x long", barrier=True).collect()


def overhead(repeats: int, torch_repeats: int, skip_torch: bool) -> list[tuple[str, float, str]]:
    """Rows (what, median seconds, all samples) on local[2] with num_proc=2."""
    import io

    import hvd_spark

    spark = _session("local[2]")
    rows = []
    med, times = _median_s(lambda: _bare_barrier(spark, 2), repeats)
    rows.append(("bare barrier job (mapInArrow, 2 tasks)", med, times))
    sink = io.StringIO()
    med, times = _median_s(
        lambda: hvd_spark.run(_trivial, num_proc=2, stdout=sink, stderr=sink, verbose=0), repeats)
    rows.append(("hvd_spark.run(num_proc=2)", med, times))
    if not skip_torch:
        from pyspark.ml.torch.distributor import TorchDistributor

        distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
        med, times = _median_s(lambda: distributor.run(_trivial), torch_repeats)
        rows.append(("TorchDistributor(2, local_mode=False).run", med, times))
    return rows


def ring_formation(num_proc: int, repeats: int) -> tuple[float, list[float]]:
    """Median seconds from the first task registering to every rank having joined."""
    import io

    from hvd_spark.runner.api import run_with_report

    def fn() -> float:
        import hvd_spark.collectives as hvd

        hvd.init()
        return time.time()

    _session(f"local[{num_proc}]")
    sink = io.StringIO()
    samples = []
    for i in range(repeats + 1):
        report = run_with_report(fn, num_proc=num_proc, stdout=sink, stderr=sink, verbose=0)
        if i:  # the first run warms the Python workers up
            samples.append(max(report.results) - report.first_registered_at)
    return statistics.median(samples), samples


def _fmt(samples: list[float]) -> str:
    return ", ".join(f"{s:.2f}" for s in samples)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a Markdown table; exit code 1 if a target is missed."""
    parser = argparse.ArgumentParser(prog="python -m hvd_spark.bench spark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="warm calls per launcher")
    parser.add_argument("--torch-repeats", type=int, default=3, help="warm TorchDistributor calls")
    parser.add_argument("--skip-torch", action="store_true", help="do not run TorchDistributor")
    parser.add_argument("--ring-procs", type=int, default=4, help="ranks for ring formation")
    parser.add_argument("--skip-ring", action="store_true", help="skip ring formation")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    ok = True
    rows = overhead(args.repeats, args.torch_repeats, args.skip_torch)
    print("| launcher (local[2], trivial fn) | median s | samples s |")
    print("|---|---:|---|")
    for what, med, samples in rows:
        print(f"| {what} | {med:.3f} | {_fmt(samples)} |")
    ours = rows[1][1]
    if len(rows) > 2:
        ratio = rows[2][1] / ours
        ok &= ratio >= TARGET_RATIO
        print(f"\nTorchDistributor / hvd_spark.run = {ratio:.1f}x (target >= {TARGET_RATIO:.0f}x)")
    if not args.skip_ring:
        med, samples = ring_formation(args.ring_procs, args.repeats)
        ok &= med < TARGET_RING_S
        print(f"\n| ring formation, num_proc={args.ring_procs} on local[{args.ring_procs}] "
              "| median s | samples s |")
        print("|---|---:|---|")
        print(f"| first task started -> all ranks joined | {med:.3f} | {_fmt(samples)} |")
        print(f"(target < {TARGET_RING_S} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
