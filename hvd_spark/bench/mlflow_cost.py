"""What MLflow tracking adds to a fit: the same small TorchEstimator fit untracked and tracked.

``python -m hvd_spark.bench mlflow [--rounds 3] [-np 2] [--epochs 2]`` fits a tiny MLP on
300 rows on a local Spark, once to warm up (Python workers, imports, the data written to
the Store), then alternates rounds: ``mlflow=False`` vs inside ``mlflow.start_run()``
against a ``sqlite:`` store in a temporary directory (params, per-epoch metrics, tags,
the logs directory and the pyfunc model logged). Each figure is the median wall time
over the rounds; the added cost is tracked - untracked. A tiny fit is the worst case:
the logging cost is fixed, the training time is not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def _session():
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return (SparkSession.builder.master("local[2]").appName("hvd_spark-bench")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.python.worker.reuse", "true")
            .getOrCreate())


def _estimator(store: str, num_proc: int, epochs: int, tracked: bool):
    import torch

    from hvd_spark.estimator import TorchEstimator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return TorchEstimator(
        num_proc=num_proc, model=model, loss=torch.nn.MSELoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        feature_cols=["features"], label_cols=["label"], validation=0.2, batch_size=32,
        epochs=epochs, random_seed=1, verbose=0, store=store, mlflow=tracked)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table."""
    parser = argparse.ArgumentParser(prog="python -m hvd_spark.bench mlflow",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-np", "--num-proc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)

    import mlflow
    import numpy as np

    spark = _session()
    rng = np.random.default_rng(7)
    x = rng.normal(size=(300, 4))
    rows = [(a.tolist(), float(b)) for a, b in zip(x, x @ np.array([0.5, -1.0, 0.25, 2.0]))]
    df = spark.createDataFrame(rows, "features array<double>, label double")
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="hvd_spark_mlflow_bench_") as tmp:
        mlflow.set_tracking_uri(f"sqlite:///{tmp}/mlflow.db")
        # Artifacts in the temporary directory too (the default root is ./mlruns).
        experiment = mlflow.create_experiment("hvd_spark-bench",
                                              artifact_location=f"{tmp}/artifacts")
        store = os.path.join(tmp, "store")
        _estimator(store, args.num_proc, args.epochs, False).fit(df)  # warm-up
        for _ in range(args.rounds):
            for tracked in (False, True):
                est = _estimator(store, args.num_proc, args.epochs, tracked)
                start = time.perf_counter()
                if tracked:
                    with mlflow.start_run(experiment_id=experiment):
                        est.fit(df)
                else:
                    est.fit(df)
                times[tracked].append(time.perf_counter() - start)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"fit, {args.epochs} epochs, {args.num_proc} ranks, median of {args.rounds}:")
    print(f"  untracked {off:7.2f} s   ({', '.join(f'{t:.2f}' for t in times[False])})")
    print(f"  tracked   {on:7.2f} s   ({', '.join(f'{t:.2f}' for t in times[True])})")
    print(f"  added     {on - off:7.2f} s   ({(on / off - 1) * 100:+.0f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
