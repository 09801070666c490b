"""TorchEstimator on local-cluster[2,1,1024]: the data is written, trained on and predicted by
two separate executor JVMs (and their Python workers), not by the driver's process."""

from __future__ import annotations

import numpy as np
import pyspark  # noqa: F401 - CI installs it: never a skip
import torch
from pyspark.ml.feature import VectorAssembler

from hvd_spark.estimator import TorchEstimator

W = np.array([1.0, -1.5, 0.5])


def _frame(spark, n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3))
    rows = [(float(a), float(b), float(c), int(v > 0)) for (a, b, c), v in zip(x, x @ W)]
    df = spark.createDataFrame(rows, "a double, b double, c double, label long")
    return VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(df)


def test_torch_estimator_on_two_executors(spark_cluster, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    est = TorchEstimator(
        num_proc=2, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.03),
        loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"],
        batch_size=32, epochs=4, validation=0.2, store=str(tmp_path / "store"), verbose=0)
    fitted = est.fit(_frame(spark_cluster, 1000, 0))
    history = fitted.getHistory()
    assert len(history) == 4 and history[-1]["train"]["loss"] < history[0]["train"]["loss"]
    assert history[-1]["validation"]["loss"] > 0
    rows = fitted.transform(_frame(spark_cluster, 200, 1)).select("label", "label__output")
    pred = [(int(np.argmax(r["label__output"])), r["label"]) for r in rows.collect()]
    assert np.mean([p == y for p, y in pred]) > 0.9
