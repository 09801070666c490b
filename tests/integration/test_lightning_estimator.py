"""LightningEstimator on real local Spark (2 ranks): resume by run_id from the Lightning
checkpoints in the store, save/load with identical predictions, and bad input."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from pyspark.ml.feature import VectorAssembler

from hvd_spark.errors import ConfigError
from hvd_spark.estimator import LightningEstimator, LightningModel


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self(batch["features"]), batch["label"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.cross_entropy(self(batch["features"]),
                                                               batch["label"]))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


@pytest.fixture(scope="module")
def frame(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(800, 3))
    rows = [(float(a), float(b), float(c), int(a - b > 0)) for a, b, c in x]
    df = spark.createDataFrame(rows, "a double, b double, c double, label long")
    return VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(df)


def _estimator(tmp_path, **overrides):
    torch.manual_seed(0)
    kwargs = dict(num_proc=2, model=Classifier(), feature_cols=["features"],
                  label_cols=["label"], batch_size=32, epochs=2, validation=0.2,
                  store=str(tmp_path / "store"), verbose=0)
    kwargs.update(overrides)
    return LightningEstimator(**kwargs)


@pytest.mark.smoke
def test_lightning_resumes_by_run_id_and_saves(frame, tmp_path):
    first = _estimator(tmp_path, run_id="lit").fit(frame)
    second = _estimator(tmp_path, run_id="lit", epochs=3).fit(frame)
    h1, h2 = first.getEpochHistory(), second.getEpochHistory()
    assert [r["epoch"] for r in h1] == [1, 2] and [r["epoch"] for r in h2] == [1, 2, 3]
    assert h2[:2] == h1, "the second fit must continue from the stored checkpoint"
    out = second.transform(frame).select("label", "label__output").collect()
    accuracy = np.mean([int(np.argmax(r["label__output"])) == r["label"] for r in out])
    assert accuracy > 0.9
    second.save(str(tmp_path / "model"))
    loaded = LightningModel.load(str(tmp_path / "model"))
    again = loaded.transform(frame).select("label__output").collect()
    assert [r["label__output"] for r in again] == [r["label__output"] for r in out]
    assert loaded.getHistory() == second.getHistory() and "val_loss" in loaded.getHistory()
    # The console's value, averaged over the ranks (Lightning's own is rank 0's).
    assert second.getHistory()["val_loss"] == h2[-1]["val_loss"]


def test_lightning_bad_input_is_a_config_error(frame, tmp_path):
    with pytest.raises(ConfigError, match="must be a LightningModule.*TorchEstimator"):
        _estimator(tmp_path, model=torch.nn.Linear(3, 2)).fit(frame)
    with pytest.raises(ConfigError, match="num_gpus must be 0 or 1"):
        _estimator(tmp_path, num_gpus=2).fit(frame)
    with pytest.raises(ConfigError, match=r"input_shapes \(column 'features'\)"):
        _estimator(tmp_path, input_shapes=[[-1, 4]]).fit(frame)
