"""After a fit, the Store's run directory holds each rank's stdout/stderr and TensorBoard
event files (both frameworks), read back with TensorBoard's own reader; local[2] Spark."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from pyspark.sql import functions as F

from hvd_spark.data.store import Store

pytestmark = pytest.mark.timeout(600)  # two fits, one of them Keras, on a shared machine


@pytest.fixture(scope="module")
def frame(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 4))
    y = (x @ np.array([1.5, -2.0, 0.75, 0.0]) > 0).astype(int)
    rows = [(*map(float, r), int(label)) for r, label in zip(x, y)]
    df = spark.createDataFrame(rows, "a double, b double, c double, d double, label long")
    return df.select(F.array("a", "b", "c", "d").alias("features"), "label")


def _scalars(logs_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logs_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


class Talkative(torch.nn.Module):
    """Prints once to each stream from every rank, as user code does."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 2))
        self.said = False

    def forward(self, x):
        if not self.said:
            import sys

            rank = os.environ.get("HVD_SPARK_RANK")
            print(f"hello from rank {rank}", flush=True)
            print(f"warning from rank {rank}", file=sys.stderr, flush=True)
            self.said = True
        return self.net(x)


def test_torch_fit_keeps_rank_logs_and_tensorboard_events(frame, tmp_path):
    from hvd_spark.estimator import TorchEstimator

    torch.manual_seed(0)
    model = Talkative()
    store = Store.create(str(tmp_path / "store"))
    fitted = TorchEstimator(
        num_proc=2, model=model, optimizer=torch.optim.Adam(model.parameters()),
        loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"],
        batch_size=16, epochs=2, validation=0.25, store=store, run_id="logged",
        verbose=0).fit(frame)
    logs = store.path(store.logs_path("logged"))  # get_logs_path is its file:// URL
    names = set(os.listdir(logs))
    for rank in (0, 1):
        with open(os.path.join(logs, f"rank-{rank}.stdout.log")) as f:
            assert f"hello from rank {rank}" in f.read()
        with open(os.path.join(logs, f"rank-{rank}.stderr.log")) as f:
            assert f"warning from rank {rank}" in f.read()
    assert any(n.startswith("events.out.tfevents.") for n in names), names
    scalars = _scalars(logs)
    history = fitted.getHistory()
    assert [s for s, _ in scalars["loss"]] == [1, 2]
    np.testing.assert_allclose([v for _, v in scalars["loss"]],
                               [h["train"]["loss"] for h in history], rtol=1e-6)
    np.testing.assert_allclose([v for _, v in scalars["val_loss"]],
                               [h["validation"]["loss"] for h in history], rtol=1e-6)
    steps = [s for s, _ in scalars["step/loss"]]
    assert steps and steps == sorted(steps) and steps[-1] > steps[0]  # global step numbers


def test_keras_fit_keeps_tensorboard_events_and_rank_logs(frame, tmp_path):
    import keras

    from hvd_spark.estimator import KerasEstimator

    store = Store.create(str(tmp_path / "store"))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    fitted = KerasEstimator(
        num_proc=2, model=model, optimizer=keras.optimizers.Adam(),
        loss="sparse_categorical_crossentropy", feature_cols=["features"],
        label_cols=["label"], batch_size=16, epochs=2, validation=0.25, store=store,
        run_id="keras-logged", callbacks=[SayHello()], verbose=0).fit(frame)
    logs = store.path(store.logs_path("keras-logged"))
    for rank in (0, 1):
        with open(os.path.join(logs, f"rank-{rank}.stdout.log")) as f:
            assert f"keras rank {rank} starts" in f.read()
    scalars = _scalars(logs)
    history = fitted.getHistory()  # Keras's shape: metric -> list per epoch
    assert [s for s, _ in scalars["loss"]] == [1, 2]
    np.testing.assert_allclose([v for _, v in scalars["loss"]], history["loss"], rtol=1e-5)
    np.testing.assert_allclose([v for _, v in scalars["val_loss"]], history["val_loss"],
                               rtol=1e-5)
    assert scalars["step/loss"]


try:  # the Keras callback class needs keras at import; CI installs it (never a skip)
    import keras as _keras

    class SayHello(_keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            print(f"keras rank {os.environ.get('HVD_SPARK_RANK')} starts", flush=True)
except ImportError as exc:  # pragma: no cover - a broken install fails the test loudly
    raise RuntimeError("the tensorflow extra must be installed") from exc
