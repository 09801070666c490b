"""A cluster job for ``spark-submit``: a KerasEstimator fit, a ``run()`` step, ``transform``.

The executors need neither hvd_spark nor TensorFlow installed: ship the job's Python
environment with it (see the deployment guide, ``docs/guides/deployment.md``):

    spark-submit --master spark://MASTER:7077 --deploy-mode client \\
        --archives job_env.tar.gz#environment \\
        --conf spark.pyspark.python=./environment/bin/python \\
        --conf spark.pyspark.driver.python=/path/to/job_env/bin/python \\
        examples/cluster_job.py --num-proc 2 --store /shared/hvd_store

1. ``KerasEstimator.fit``: a small classifier on a synthetic DataFrame, on ``--num-proc``
   ranks (its per-epoch metrics stream to this console).
2. ``hvd_spark.run``: every rank scores the fitted model on its own held-out shard and the
   ranks average their accuracies with ``hvd.allreduce``; each rank prints where it ran and
   which Python it ran on (those lines reach this console as ``[rank] ...``).
3. ``transform``: the fitted model predicts a held-out DataFrame on the executors.

Exits non-zero when the model did not learn.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

_FEATURES = 4
_WEIGHTS = (1.0, -2.0, 0.5, 1.5)


def make_rows(n: int, seed: int) -> list[tuple[list[float], float]]:
    """``n`` rows of (features, label): the label says whether a fixed linear score is > 0."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, _FEATURES))
    y = (x @ np.array(_WEIGHTS) > 0).astype(float)
    return [(row.tolist(), float(label)) for row, label in zip(x, y)]


def build_model():
    """A small Keras classifier over ``_FEATURES`` inputs."""
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input(shape=(_FEATURES,)),
                             keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(1, activation="sigmoid")])


def score_on_ranks(model_json: str, weights: list) -> dict:
    """Runs on every rank: this rank's held-out accuracy, and the ranks' average."""
    import socket

    import keras
    import numpy as np

    import hvd_spark
    import hvd_spark.tensorflow as hvd

    hvd.init()
    model = keras.models.model_from_json(model_json)
    model.set_weights(weights)
    rows = make_rows(500, seed=100 + hvd.rank())  # this rank's own shard
    x = np.array([r[0] for r in rows], dtype=np.float32)
    y = np.array([r[1] for r in rows])
    accuracy = float(np.mean((model.predict(x, verbose=0)[:, 0] > 0.5) == y))
    mean = float(hvd.allreduce(np.array([accuracy]), name="accuracy")[0])
    print(f"rank {hvd.rank()} of {hvd.size()} on {socket.gethostname()}: accuracy "
          f"{accuracy:.3f} (mean {mean:.3f}); python {sys.executable}; "
          f"hvd_spark from {os.path.dirname(hvd_spark.__file__)}", flush=True)
    return {"rank": hvd.rank(), "host": socket.gethostname(), "accuracy": accuracy,
            "mean": mean, "python": sys.executable,
            "hvd_spark": os.path.dirname(hvd_spark.__file__)}


def main(argv: list[str] | None = None) -> int:
    """Fit, score on the ranks, transform; 0 when the model learned."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-proc", type=int, default=2, help="ranks (Spark task slots)")
    parser.add_argument("--store", required=True,
                        help="a directory (or URL) every executor can reach: the Store")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args(argv)

    import keras
    import numpy as np
    from pyspark.sql import SparkSession

    import hvd_spark
    from hvd_spark.estimator import KerasEstimator

    spark = SparkSession.builder.appName("hvd_spark-cluster-job").getOrCreate()
    schema = "features array<double>, label double"
    train = spark.createDataFrame(make_rows(2000, seed=0), schema)
    test = spark.createDataFrame(make_rows(400, seed=1), schema)

    estimator = KerasEstimator(
        num_proc=args.num_proc, model=build_model(), optimizer=keras.optimizers.Adam(0.01),
        loss="binary_crossentropy", metrics=["accuracy"], feature_cols=["features"],
        label_cols=["label"], batch_size=32, epochs=args.epochs, validation=0.1,
        store=args.store, verbose=1)
    fitted = estimator.fit(train)
    history = fitted.getHistory()
    print(f"fit: loss {history['loss'][0]:.4f} -> {history['loss'][-1]:.4f}, "
          f"accuracy {history['accuracy'][-1]:.3f}")

    model = fitted.getModel()
    ranks = hvd_spark.run(score_on_ranks, args=(model.to_json(), model.get_weights()),
                          num_proc=args.num_proc)
    print(f"run: mean held-out accuracy over {len(ranks)} ranks {ranks[0]['mean']:.3f}, "
          f"ranks on {sorted({r['host'] for r in ranks})}")

    predicted = fitted.transform(test).select("label", "label__output").collect()
    accuracy = float(np.mean([(r["label__output"] > 0.5) == (r["label"] > 0.5)
                              for r in predicted]))
    print(f"transform: accuracy {accuracy:.3f} on {len(predicted)} held-out rows")
    spark.stop()
    return 0 if accuracy > 0.85 and ranks[0]["mean"] > 0.85 else 1


if __name__ == "__main__":
    sys.exit(main())
