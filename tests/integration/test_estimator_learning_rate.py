"""Horovod's learning-rate rule in the Torch and Keras Estimators, on real local Spark.

The ranks record the rate they train with (through Horovod's ``train_minibatch_fn`` for
torch, a callback for Keras) into files of the test's directory; what the fit saves
(checkpoints, ``getOptimizer()``) must carry the user's rate; a resumed fit on another
number of ranks scales from it again.
"""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from hvd_spark.data import Store
from hvd_spark.estimator import KerasEstimator, TorchEstimator


@pytest.fixture(scope="module")
def train(spark):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(256, 3))
    y = (x @ np.array([1.0, -1.0, 0.5]) > 0).astype(float)
    rows = [(a.tolist(), float(b)) for a, b in zip(x, y)]
    return spark.createDataFrame(rows, "features array<double>, label double")


def _recorded(directory: Path) -> set[float]:
    return {float(v) for f in directory.glob("lr_*") for v in f.read_text().split()}


def _recording_minibatch(directory: str):
    """Horovod's train_minibatch_fn: the default step, after noting each group's rate."""

    def make():
        from hvd_spark.estimator.torch_worker import default_minibatch

        def step(model, optimizer, *args):
            with open(os.path.join(directory, f"lr_{os.getpid()}"), "a") as out:
                out.write(" ".join(str(g["lr"]) for g in optimizer.param_groups) + "\n")
            return default_minibatch(model, optimizer, *args)

        return step

    return make


def _torch(tmp_path: Path, record: Path, **overrides) -> TorchEstimator:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    kwargs = dict(num_proc=2, model=model,
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5),
                  loss=torch.nn.BCEWithLogitsLoss(), feature_cols=["features"],
                  label_cols=["label"], batch_size=32, epochs=1, store=str(tmp_path / "store"),
                  run_id="lr", train_minibatch_fn=_recording_minibatch(str(record)))
    kwargs.update(overrides)
    return TorchEstimator(**kwargs)


def test_torch_ranks_train_at_size_times_the_rate_and_save_the_users(train, tmp_path, caplog):
    import torch

    first, resumed = tmp_path / "first", tmp_path / "resumed"
    first.mkdir()
    resumed.mkdir()
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        model = _torch(tmp_path, first).fit(train)
    assert _recorded(first) == {0.1}, "2 ranks train at 2 x 0.05, as in Horovod"
    assert "learning rate 0.05 x 2 rank(s) = 0.1" in caplog.text
    assert model.getOptimizer().param_groups[0]["lr"] == 0.05
    store = Store.create(str(tmp_path / "store"))
    _, blob = store.latest_checkpoint("lr")
    saved = torch.load(io.BytesIO(blob), weights_only=False)
    assert saved["optimizer"]["param_groups"][0]["lr"] == 0.05, "checkpoints keep the user's"
    # Resumed on one rank: the rate follows the new size, scaled from the saved one once.
    again = _torch(tmp_path, resumed, num_proc=1, epochs=2).fit(train)
    assert _recorded(resumed) == {0.05}
    assert again.getOptimizer().param_groups[0]["lr"] == 0.05


def test_torch_scale_learning_rate_false_keeps_the_rate(train, tmp_path, caplog):
    record = tmp_path / "record"
    record.mkdir()
    with caplog.at_level(logging.INFO, logger="hvd_spark"):
        _torch(tmp_path, record, scale_learning_rate=False).fit(train)
    assert _recorded(record) == {0.05}
    assert "scale_learning_rate=False" in caplog.text and "0.05 as given" in caplog.text


def test_scale_learning_rate_must_be_a_bool(train, tmp_path):
    from hvd_spark.errors import ConfigError

    with pytest.raises(ConfigError, match="scale_learning_rate must be True"):
        _torch(tmp_path, tmp_path, scale_learning_rate="yes").fit(train)
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.parquet"))


def test_keras_ranks_train_scaled_with_horovods_callbacks_and_save_the_users(train, tmp_path):
    import keras

    from hvd_spark.tensorflow.callbacks import LearningRateScheduleCallback

    record = str(tmp_path)

    class RecordRate(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            with open(os.path.join(record, f"lr_{os.getpid()}"), "a") as out:
                out.write(f"{float(np.asarray(self.model.optimizer.learning_rate)):.6f}\n")

    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(inputs))
    # Horovod overwrites its schedule callbacks' initial_lr with the scaled rate.
    schedule = LearningRateScheduleCallback(initial_lr=7.0, multiplier=1.0)
    est = KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.SGD(0.05),
                         loss="binary_crossentropy", feature_cols=["features"],
                         label_cols=["label"], batch_size=32, epochs=1, verbose=0,
                         store=str(tmp_path / "store"), callbacks=[schedule, RecordRate()])
    fitted = est.fit(train)
    assert _recorded(tmp_path) == {0.1}
    assert np.isclose(float(fitted.getOptimizer().learning_rate), 0.05)
