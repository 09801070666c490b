"""make_converter on real local[2] Spark, read by 2 ranks of hvd_spark.run (torch and TF).

The pattern petastorm's ``make_spark_converter`` documents: the converter is made on the
driver and shipped in the rank function's closure; each rank opens a loader.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest

import hvd_spark
from hvd_spark.data import make_converter
from hvd_spark.errors import DataError

ROWS, BATCH, RANKS = 200, 16, 2
STEPS = (ROWS // RANKS) // BATCH  # 6 batches per rank and epoch; 8 rows dropped


@pytest.fixture(scope="module")
def frame(spark):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    labels = (x[:, 0] + x[:, 1] > 0).astype(int)  # separable: the loss must fall
    rows = [(i, x[i].tolist(), float(x[i, 2]) * 2.0, int(labels[i])) for i in range(ROWS)]
    return spark.createDataFrame(
        rows, "id long, features array<float>, scale double, label int")


def _files(root: str) -> dict[str, int]:
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, names in os.walk(root) for f in names}


@pytest.fixture(scope="module")
def converter(frame, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("converter_store"))
    conv = make_converter(frame, root)
    written = _files(root)
    again = make_converter(frame, root)  # same content: the cached files, nothing written
    assert again.spec.key == conv.spec.key and _files(root) == written
    yield conv
    conv.delete()
    assert not any(name.endswith(".parquet") for name in _files(root))


def test_unsupported_column_named_before_any_write(frame, tmp_path):
    from pyspark.sql import functions as F

    with pytest.raises(DataError, match=r"column 'name' has type string.*columns=\[\.\.\.\]"):
        make_converter(frame.withColumn("name", F.lit("a")), str(tmp_path))
    assert not os.listdir(tmp_path)


def _check_epoch(results: list[dict]) -> None:
    assert [r["batches"] for r in results] == [STEPS] * RANKS  # equal steps per rank
    ids = [i for r in results for i in r["ids"]]
    assert len(ids) == len(set(ids)) == RANKS * STEPS * BATCH  # every row at most once
    assert set(ids) <= set(range(ROWS)) and ROWS - len(ids) < RANKS * (BATCH + 1)
    assert {r["rank"] for r in results} == set(range(RANKS))


@pytest.mark.smoke
def test_torch_loaders_on_two_ranks(converter):
    assert len(converter) == ROWS and converter.columns == ["id", "features", "scale", "label"]

    def train():  # a closure: the converter travels pickled inside it
        import torch

        import hvd_spark.torch as hvd

        hvd.init()
        with converter.make_torch_dataloader(batch_size=BATCH, num_epochs=1) as loader:
            batches = list(loader)
        first = batches[0]
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters())
        losses = []
        # num_epochs=None: infinite, as in petastorm; the loop counts the steps.
        with converter.make_torch_dataloader(batch_size=BATCH) as loader:
            for step, batch in enumerate(loader):
                if step == 8 * loader.steps_per_epoch:
                    break
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(batch["features"]),
                                                         batch["label"])  # int64 targets
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return {
            "rank": hvd.rank(), "batches": len(batches),
            "ids": [int(i) for b in batches for i in b["id"]],
            "dtypes": {k: str(v.dtype) for k, v in first.items()},
            "shape": tuple(first["features"].shape),
            "loss_first": float(np.mean(losses[:6])), "loss_last": float(np.mean(losses[-6:])),
        }

    results = hvd_spark.run(train, num_proc=RANKS, stdout=io.StringIO())
    _check_epoch(results)
    for r in results:
        assert r["dtypes"] == {"id": "torch.int64", "features": "torch.float32",
                               "scale": "torch.float32", "label": "torch.int64"}
        assert r["shape"] == (BATCH, 4)
        assert r["loss_last"] < 0.6 * r["loss_first"], r


def test_tf_datasets_on_two_ranks(converter):
    def read():
        import tensorflow as tf

        import hvd_spark.tensorflow as hvd

        hvd.init()
        with converter.make_tf_dataset(batch_size=BATCH, num_epochs=1) as dataset:
            cardinality = int(dataset.cardinality())
            batches = list(dataset)
        with converter.make_tf_dataset(batch_size=BATCH) as endless:
            infinite = int(endless.cardinality()) == int(tf.data.INFINITE_CARDINALITY)
            taken = sum(1 for _ in endless.take(3 * STEPS))  # past one epoch
        # A collective over each rank's batch count: equal steps, or it would not match.
        total = hvd.allreduce(tf.constant(float(len(batches))), op=hvd.Sum)
        return {
            "rank": hvd.rank(), "batches": len(batches), "cardinality": cardinality,
            "ids": [int(i) for b in batches for i in b["id"].numpy()],
            "dtypes": {k: v.dtype.name for k, v in dataset.element_spec.items()},
            "shape": tuple(dataset.element_spec["features"].shape),
            "infinite": infinite, "taken": taken, "total": float(total),
            "label_matches": all(
                np.array_equal(b["label"].numpy(),
                               (b["features"].numpy()[:, 0] + b["features"].numpy()[:, 1] > 0))
                for b in batches),
        }

    results = hvd_spark.run(read, num_proc=RANKS, stdout=io.StringIO())
    _check_epoch(results)
    for r in results:
        assert r["cardinality"] == STEPS and r["total"] == RANKS * STEPS
        assert r["dtypes"] == {"id": "int64", "features": "float32", "scale": "float32",
                               "label": "int64"}
        assert r["shape"] == (BATCH, 4)
        assert r["infinite"] and r["taken"] == 3 * STEPS
        assert r["label_matches"]
