"""The convergence benchmark's parts that need no Spark: the data, the learning-rate rule
it reads from each Estimator, the table, the gap lines and the plot."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_spark.bench import convergence
from hvd_spark.bench.convergence_frameworks import SIDE, Plan, estimator_lr


def test_digits_are_upscaled_scaled_and_split_once():
    data = convergence.load_digits_28()
    assert data.x_train.shape[1] == data.x_test.shape[1] == SIDE * SIDE
    assert len(data.x_train) + len(data.x_test) == 1797
    assert len(data.x_test) == 449
    assert data.x_train.min() == 0.0 and data.x_train.max() == 1.0
    image = data.x_train[0].reshape(SIDE, SIDE)
    assert not image[:2].any() and not image[:, -2:].any()  # the MNIST-like padding
    np.testing.assert_array_equal(image[2:5, 2:5], image[2, 2])  # one pixel, a 3x3 block
    again = convergence.load_digits_28(train_rows=10, test_rows=5)
    np.testing.assert_array_equal(again.x_test, data.x_test[:5])  # the same held-out rows


def test_effective_rate_follows_each_estimators_rule():
    from hvd_spark.estimator import LightningEstimator, TorchEstimator

    plan = Plan(epochs=1, batch_size=64, num_proc=2, lr=0.01, seed=0)
    assert plan.global_batch == 128
    scaled = TorchEstimator()
    assert scaled.hasParam("scale_learning_rate")
    assert estimator_lr(scaled, plan) == pytest.approx(0.02)
    assert estimator_lr(TorchEstimator(scale_learning_rate=False), plan) == 0.01
    assert estimator_lr(LightningEstimator(), plan) == 0.01


def _runs() -> list[convergence.Run]:
    runs = []
    for seed, (plain, est) in enumerate([(0.5, 0.6), (0.7, 0.8)]):
        for kind, loss, lr in (("plain", plain, 0.02), ("estimator", est, 0.02)):
            runs.append(convergence.Run("torch", kind, seed, 128, lr, [2.3, loss],
                                        0.9 - loss / 10, 1.0 + seed))
    return runs


def test_table_and_gaps_summarize_over_seeds():
    lines = convergence.table(_runs(), given_lr=0.01)
    assert lines[0].startswith("| framework | run | global batch | lr per step |")
    assert lines[2] == ("| torch | plain, 1 process | 128 | 0.02 | 0.6000 (0.5000-0.7000) "
                        "| 0.840 (0.830-0.850) | 1.5 |")
    assert lines[3].startswith("| torch | TorchEstimator, 2 ranks | 128 | 0.02 (0.01 x 2 ranks) "
                               "| 0.7000 (0.6000-0.8000) |")
    assert convergence.gaps(_runs()) == [
        "torch: estimator - plain: accuracy -0.010, final train loss +0.1000"]


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "curves.png"
    convergence.plot(_runs(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
