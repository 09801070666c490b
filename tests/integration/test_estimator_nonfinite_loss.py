"""A fit whose training loss turns NaN/inf stops with an error naming the epoch and step."""

from __future__ import annotations

import sys

import cloudpickle
import numpy as np
import pytest
import torch
from pyspark.ml.feature import VectorAssembler

from hvd_spark.errors import WorkerFailedError
from hvd_spark.estimator import KerasEstimator, TorchEstimator

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on the workers' path


class NanAfter(torch.nn.Module):
    """A linear model whose output turns NaN from its ``bad_call``-th training call on (0-based)."""

    def __init__(self, bad_call: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)
        self.bad_call = bad_call
        self.calls = 0

    def forward(self, x):
        out = self.linear(x)
        if self.training:
            if self.calls >= self.bad_call:
                out = out * float("nan")
            self.calls += 1
        return out


@pytest.fixture(scope="module")
def frame(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3))
    rows = [(float(a), float(b), float(c), float(a - b)) for a, b, c in x]
    df = spark.createDataFrame(rows, "a double, b double, c double, y double")
    return VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(df)


def test_torch_fit_stops_at_the_step_whose_loss_is_nan(frame, tmp_path):
    torch.manual_seed(0)
    model = NanAfter(bad_call=5)  # 4 steps an epoch: the 6th call is epoch 2, step 2
    est = TorchEstimator(
        num_proc=2, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["y"], batch_size=16,
        epochs=5, train_steps_per_epoch=4, store=str(tmp_path / "store"), run_id="nan",
        verbose=0)
    with pytest.raises(WorkerFailedError) as info:
        est.fit(frame)
    root = info.value.root_cause
    assert root.message.startswith("DataError: the training loss became nan at epoch 2 of 5, "
                                   "step 2 of 4 (rank "), root.message
    assert "Lower the learning rate" in root.message
    assert not root.lost  # a deterministic failure: never retried
    # The epoch before the NaN was checkpointed; nothing after it was.
    assert est._store().list_checkpoints("nan") == [0]


def test_keras_fit_stops_at_the_first_step_with_an_infinite_loss(frame, tmp_path):
    import keras

    keras.utils.set_random_seed(0)
    # Weights of 1e20 make the first squared error overflow float32 (max ~3.4e38).
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
        1, kernel_initializer=keras.initializers.Constant(1e20))])
    est = KerasEstimator(
        num_proc=2, model=model, optimizer=keras.optimizers.SGD(0.01), loss="mse",
        feature_cols=["features"], label_cols=["y"], batch_size=16, epochs=3,
        train_steps_per_epoch=4, store=str(tmp_path / "store"), verbose=0)
    with pytest.raises(WorkerFailedError) as info:
        est.fit(frame)
    root = info.value.root_cause
    assert root.message.startswith("DataError: the training loss became inf at epoch 1 of 3, "
                                   "step 1 of 4 (rank "), root.message
