"""Progress travels from the training loops to the driver as structured events on real
local[2] Spark: hvd_spark.run's progress sink, and the Estimators' bars."""

from __future__ import annotations

import re

import numpy as np
import pytest
from pyspark.sql import functions as F

import hvd_spark


def _send_events():
    import hvd_spark.collectives as hvd
    from hvd_spark.runner import progress_events

    hvd.init()
    sent = progress_events.send(hvd.rank(), {"kind": "epoch", "epoch": 1, "rank": hvd.rank()})
    # Step events closer than the rate limit are dropped on the rank's side.
    steps = [progress_events.send(hvd.rank(), {"kind": "step", "step": i}) for i in range(3)]
    return sent, steps


@pytest.mark.smoke
def test_events_reach_the_driver_sink_with_their_rank(spark):
    events = []
    results = hvd_spark.run(_send_events, num_proc=2, progress=lambda r, e: events.append((r, e)))
    assert [sent for sent, _ in results] == [True, True]
    epochs = sorted((r, e["rank"]) for r, e in events if e["kind"] == "epoch")
    assert epochs == [(0, 0), (1, 1)]
    steps = [e["step"] for r, e in events if e["kind"] == "step" and r == 0]
    assert steps == [0], "of a burst of step events, the rate limit lets the first through"
    assert not [e for _, e in events if e["kind"] == "hello"]


def test_a_launcher_without_a_progress_service_gets_printed_lines():
    from hvd_spark.runner import run_local

    results = run_local(_send_events, num_proc=2)
    assert [sent for sent, _ in results] == [False, False]


@pytest.fixture(scope="module")
def frame(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(800, 4))
    y = (x @ np.array([1.5, -2.0, 0.75, 0.0]) > 0).astype(int)
    rows = [(*map(float, r), int(label)) for r, label in zip(x, y)]
    df = spark.createDataFrame(rows, "a double, b double, c double, d double, label long")
    return df.select(F.array("a", "b", "c", "d").alias("features"), "label")


def _final_lines(text: str) -> list[str]:
    return [line for line in text.replace("\r", "\n").splitlines() if line.strip()]


def test_torch_fit_draws_a_bar_per_epoch_from_events(frame, tmp_path, capsys):
    import torch

    from hvd_spark.estimator import TorchEstimator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    TorchEstimator(num_proc=2, model=model, optimizer=torch.optim.Adam(model.parameters()),
                   loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"],
                   label_cols=["label"], batch_size=16, epochs=2, validation=0.25,
                   store=str(tmp_path / "store"), verbose=1).fit(frame)
    out, err = capsys.readouterr()
    lines = _final_lines(err)
    for epoch in (1, 2):
        done = [line for line in lines if line.startswith(f"epoch {epoch}/2: 100%")]
        assert done and "val_loss=" in done[-1], f"no finished bar for epoch {epoch}: {lines}"
    running = [line for line in lines if "samples/s=" in line]
    assert running and all(re.search(r"<\d\d:\d\d", line) for line in running)  # ETA
    # Progress no longer comes as rank 0's printed lines.
    assert not re.search(r"^\[0\] epoch \d+/2:", out, re.M)


def test_keras_fit_has_no_keras_progress_on_the_workers(frame, tmp_path, capsys):
    import keras

    from hvd_spark.estimator import KerasEstimator

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.Adam(),
                   loss="sparse_categorical_crossentropy", feature_cols=["features"],
                   label_cols=["label"], batch_size=16, epochs=1,
                   store=str(tmp_path / "store"), verbose=1).fit(frame)
    out, err = capsys.readouterr()
    assert "━" not in out and "/step" not in out  # Keras's own bar and its step timings
    assert any(line.startswith("epoch 1/1: 100%") and "loss=" in line
               for line in _final_lines(err))


_RUN_SCRIPT = """
import os, sys
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
import hvd_spark

def fn():
    import hvd_spark.collectives as hvd
    hvd.init()
    return hvd.rank()

print(hvd_spark.run(fn, num_proc=2))
print(hvd_spark.run(fn, num_proc=2, verbose=0))
"""


def test_verbose_messages_show_without_logging_setup(tmp_path):
    import os
    import subprocess
    import sys

    # A fresh driver process: nothing configured logging, as in a plain script or notebook.
    done = subprocess.run([sys.executable, "-c", _RUN_SCRIPT], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env={**os.environ})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-2:] == ["[0, 1]", "[0, 1]"]
    said = [line for line in done.stderr.splitlines() if line.startswith("hvd_spark")]
    assert sum("starting 2 ranks" in line for line in said) == 1, said  # verbose=0: quiet
    assert sum("ranks assigned: 0 on" in line for line in said) == 1, said
    assert sum("2 ranks finished" in line for line in said) == 1, said
