"""``fit(df)`` without a Store: the ranks train on the rows their Spark tasks hand over.

Nothing is written to a Store; the checks, the validation split and MLflow lineage work as
on the Store path, and training comes out as the Store path's within the bound below.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import sys

import cloudpickle
import numpy as np
import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest
import torch

from hvd_spark.data.rank_share import share_directory
from hvd_spark.errors import ConfigError, DataError
from hvd_spark.estimator import TorchEstimator, direct_data
from hvd_spark.runner.backend import Backend

cloudpickle.register_pickle_by_value(sys.modules[__name__])

_TRUE_W = np.array([1.0, -2.0, 0.5, 3.0])


@pytest.fixture(scope="module")
def frame(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(480, 4))
    y = x @ _TRUE_W + 0.25
    rows = [(i, a.tolist(), float(b), int(i % 5 == 0)) for i, (a, b) in enumerate(zip(x, y))]
    return spark.createDataFrame(rows, "id long, features array<double>, y double, is_val int")


def _estimator(**overrides) -> TorchEstimator:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    kwargs = dict(num_proc=2, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                  loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["y"],
                  batch_size=16, epochs=4, random_seed=1, verbose=0)
    kwargs.update(overrides)
    return TorchEstimator(**kwargs)


def _shares_left() -> list[str]:
    return glob.glob(os.path.join(share_directory(), "hvd_spark-*.arrow"))


@pytest.mark.smoke
def test_a_fit_without_a_store_trains_from_the_dataframe_and_logs_its_lineage(
        frame, mlflow_client, caplog):
    import mlflow

    before = set(_shares_left())
    caplog.set_level(logging.INFO, "hvd_spark.estimator")
    est = _estimator(validation="is_val")
    with mlflow.start_run() as run:
        fitted = est.fit(frame)

    assert est.getStore() is None  # no Store was made up, nothing written to one
    assert set(_shares_left()) <= before  # each task removed its share
    val_losses = [r["val_loss"] for r in fitted.records]
    assert len(val_losses) == 4 and all("loss" in r for r in fitted.records)
    assert val_losses[-1] < 0.05 * val_losses[0]
    weights = fitted.getModel().weight.detach().numpy().ravel()
    assert np.allclose(weights, _TRUE_W, atol=0.1), weights
    said = [r.getMessage() for r in caplog.records if "fit without a store" in r.getMessage()]
    assert any("starts over from epoch 1" in m for m in said), said

    data = mlflow_client.get_run(run.info.run_id)
    assert data.data.tags["hvd_spark.data"] == "direct"
    assert "hvd_spark.store" not in data.data.tags
    assert data.data.params["train_rows"] == "384" and data.data.params["val_rows"] == "96"
    (logged,) = data.inputs.dataset_inputs  # the user's DataFrame, not a derived one
    tags = {t.key: t.value for t in logged.tags}
    assert tags["mlflow.data.context"] == "training"
    assert tags["hvd_spark.validation"] == "column is_val"  # the split is a tag of it
    columns = {f["name"] for f in json.loads(logged.dataset.schema)["mlflow_colspec"]}
    assert columns == {"id", "features", "y", "is_val"}
    assert logged.dataset.digest


def test_the_direct_path_trains_as_the_store_path_does(frame, tmp_path):
    direct = _estimator(validation=0.2).fit(frame)
    stored = _estimator(validation=0.2, store=str(tmp_path / "store")).fit(frame)
    # Different shares of rows per rank (Spark's partitions vs the Store's shards), the same
    # model, data, global batch and epochs: the same fit within SGD's noise on this problem.
    w_direct = direct.getModel().weight.detach().numpy().ravel()
    w_stored = stored.getModel().weight.detach().numpy().ravel()
    assert np.allclose(w_direct, w_stored, atol=0.05), (w_direct, w_stored)
    losses = [m.records[-1]["val_loss"] for m in (direct, stored)]
    assert max(losses) < 0.02, losses
    assert len(direct.records) == 4


class _NoDataFrames(Backend):
    def run(self, fn, args=(), kwargs=None, env=None):
        raise AssertionError("never started")

    def num_processes(self) -> int:
        return 2


def test_bad_input_is_refused_before_any_rank_starts(frame, spark):
    with pytest.raises(ConfigError, match="cannot hand a DataFrame's rows.*store="):
        _estimator(num_proc=None, backend=_NoDataFrames()).fit(frame)
    tiny = spark.createDataFrame([([1.0, 2.0, 3.0, 4.0], 1.0)], "features array<double>, y double")
    with pytest.raises(DataError, match="1 training rows are fewer than num_proc x batch_size"):
        _estimator().fit(tiny)
    with pytest.raises(DataError, match="column 'nope' not found"):
        _estimator(label_cols=["nope"]).fit(frame)
    from pyspark.sql import functions as F

    narrow = frame.select(F.slice("features", 1, 3).alias("features"), "y")
    with pytest.raises(ConfigError, match="dry run"):  # the model takes 4 features, not 3
        _estimator().fit(narrow)


def test_the_warning_about_what_is_lost_comes_once(caplog, monkeypatch):
    monkeypatch.setattr(direct_data, "_WARNED", type(direct_data._WARNED)())
    caplog.set_level(logging.WARNING, "hvd_spark.estimator")
    direct_data.warn_once()
    direct_data.warn_once()
    assert sum("fit without a store" in r.getMessage() for r in caplog.records) == 1
