"""``python -m hvd_spark.bench <benchmark> [options]``: run one benchmark, print its table."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "allreduce": ("hvd_spark.bench.allreduce", "collectives busbw vs torch Gloo and MPI"),
    "latency": ("hvd_spark.bench.latency", "small allreduce latency: MPI backend vs TCP/shm"),
    "torch": ("hvd_spark.bench.torch_bench", "DistributedOptimizer vs torch DDP (Gloo)"),
    "keras": ("hvd_spark.bench.keras_bench", "Keras DistributedOptimizer vs MWMS"),
    "spark": ("hvd_spark.bench.spark_overhead", "hvd_spark.run overhead vs TorchDistributor"),
    "distributor": ("hvd_spark.bench.distributor_bench",
                    "TorchDistributor: hvd_spark's vs pyspark's, start-up and DDP steps"),
    "reader": ("hvd_spark.bench.reader_bench", "Parquet reader rows/s vs a plain scan"),
    "dataframe": ("hvd_spark.bench.dataframe_bench",
                  "training from a DataFrame: through a Store vs straight from Spark"),
    "transform": ("hvd_spark.bench.transform_bench", "Model.transform rows/s: Arrow vs pandas"),
    "scaling": ("hvd_spark.bench.scaling", "predicted efficiency on 8-512 hosts (needs root)"),
    "chaos": ("hvd_spark.bench.chaos", "workloads on namespace hosts under faults (root)"),
    "elastic": ("hvd_spark.bench.elastic_bench", "elastic recovery time and commit cost"),
    "paths": ("hvd_spark.bench.paths_bench", "allreduce in place vs out of place, per dtype"),
    "timeline": ("hvd_spark.bench.timeline_bench", "training step time, timeline off vs on"),
    "autotune": ("hvd_spark.bench.autotune_bench", "autotune on vs off, alternating jobs"),
    "mlflow": ("hvd_spark.bench.mlflow_cost", "a fit's added cost of MLflow tracking"),
    "convergence": ("hvd_spark.bench.convergence",
                    "plain training vs each Estimator: loss, accuracy, curves"),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the named benchmark's ``main(argv)``."""
    argv = sys.argv[1:] if argv is None else argv
    lines = [f"  {name:10s} {desc}" for name, (_, desc) in BENCHMARKS.items()]
    usage = ("usage: python -m hvd_spark.bench <benchmark> [options]\n\nbenchmarks:\n"
             + "\n".join(lines) + "\n\n`python -m hvd_spark.bench <benchmark> --help` lists "
             "a benchmark's options.")
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage)
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        if argv:
            print(f"unknown benchmark {argv[0]!r}", file=sys.stderr)
        print(usage, file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
