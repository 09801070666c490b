"""Horovod's learning-rate rule for the Estimators: the pure parts, on real optimizers."""

from __future__ import annotations

import keras
import numpy as np
import torch

from hvd_spark.estimator.keras_rates import KerasRates, ScaledSchedule
from hvd_spark.estimator.learning_rate import TorchRates, describe, keras_rate, unscale


def test_unscale_gives_the_users_rate_back_exactly():
    assert unscale(0.01 * 3, 0.01, 3) == 0.01  # 0.03 / 3 is 0.009999999999999998
    assert unscale(0.5, 0.01, 2) == 0.25  # changed during training: divided back
    assert unscale(0.07, 0.07, 1) == 0.07
    assert unscale(float(np.float32(0.05 * 3)), 0.05, 3) == 0.05  # float32 storage


def test_the_driver_says_what_the_ranks_train_with_and_how_to_keep_the_rate():
    text = describe([0.01], 2, True, "TorchEstimator")
    assert "learning rate 0.01 x 2 rank(s) = 0.02" in text
    assert "scale_learning_rate=False to keep 0.01" in text
    groups = describe([0.1, 0.01], 4, True, "TorchEstimator")
    assert "[0.1, 0.01] x 4 rank(s) = [0.4, 0.04]" in groups
    off = describe([0.01], 2, False, "KerasEstimator")
    assert "0.01 as given" in off and "scale_learning_rate=False" in off
    assert "schedule x 2" in describe(None, 2, True, "KerasEstimator")


def test_torch_groups_train_scaled_and_save_the_users_rates():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.01},
                                 {"params": model[1].parameters()}], lr=0.3, momentum=0.9)
    rates = TorchRates(optimizer, 3)
    assert [g["lr"] for g in optimizer.param_groups] == [0.01 * 3, 0.3 * 3]
    saved = rates.unscaled_state()
    assert [g["lr"] for g in saved["param_groups"]] == [0.01, 0.3]
    # The live optimizer keeps training at the scaled rate.
    assert [g["lr"] for g in optimizer.param_groups] == [0.01 * 3, 0.3 * 3]
    # Resumed on another number of ranks: scaled from the saved rate, never twice.
    optimizer.load_state_dict(saved)
    TorchRates(optimizer, 2)
    assert [g["lr"] for g in optimizer.param_groups] == [0.02, 0.6]


def test_torch_scheduler_sees_the_scaled_base_rate():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)  # sets initial_lr
    rates = TorchRates(optimizer, 2)
    assert optimizer.param_groups[0]["initial_lr"] == 0.2
    assert rates.unscaled_state()["param_groups"][0]["initial_lr"] == 0.1


def test_torch_factor_one_changes_nothing():
    optimizer = torch.optim.Adam(torch.nn.Linear(2, 1).parameters(), lr=0.003)
    rates = TorchRates(optimizer, 1)
    assert optimizer.param_groups[0]["lr"] == 0.003
    assert rates.unscaled_state()["param_groups"][0]["lr"] == 0.003


def test_keras_float_rate_scaled_and_unscaled_in_what_is_kept():
    config = keras.optimizers.serialize(keras.optimizers.SGD(learning_rate=0.05, momentum=0.9))
    assert np.isclose(keras_rate(config), 0.05)  # Keras keeps it in float32
    rates = KerasRates(config, 2)
    assert np.isclose(float(rates.optimizer.learning_rate), 0.1)
    # DistributedOptimizer rebuilds the optimizer from its config: the scaled rate survives.
    rebuilt = type(rates.optimizer).from_config(rates.optimizer.get_config())
    assert np.isclose(float(rebuilt.learning_rate), 0.1)
    kept = rates.unscaled_config(rebuilt)
    assert kept["config"]["learning_rate"] == rates.base  # the user's, not a division's
    assert kept["config"]["momentum"] == 0.9
    # A resume assigns the old run's variables (its scaled rate among them), then the
    # checkpoint's user rate times this run's factor.
    rebuilt.learning_rate = 0.4  # as 4 ranks left it
    rates.restore(rebuilt, 0.05)
    assert np.isclose(float(rebuilt.learning_rate), 0.1)


def test_keras_schedule_is_wrapped_and_survives_a_config_round_trip():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    config = keras.optimizers.serialize(keras.optimizers.Adam(learning_rate=schedule))
    assert keras_rate(config) is None
    rates = KerasRates(config, 2)
    assert rates.scaled is None and rates.user_rate(rates.optimizer) is None
    rebuilt = type(rates.optimizer).from_config(rates.optimizer.get_config())
    wrapped = rebuilt._learning_rate
    assert isinstance(wrapped, ScaledSchedule)
    for step in (0, 10, 25):
        assert np.isclose(float(wrapped(step)), 2 * float(schedule(step)))
    # The model keeps the user's schedule, not the wrapper.
    kept = rates.unscaled_config(rebuilt)
    assert kept["config"]["learning_rate"]["class_name"] == "ExponentialDecay"


def test_keras_rate_callbacks_get_the_scaled_rate_as_initial_lr():
    from hvd_spark.tensorflow import callbacks as hvd_callbacks

    config = keras.optimizers.serialize(keras.optimizers.SGD(learning_rate=0.05))
    schedule = hvd_callbacks.LearningRateScheduleCallback(initial_lr=9.0, multiplier=1.0)
    warmup = hvd_callbacks.LearningRateWarmupCallback(initial_lr=9.0, warmup_epochs=2)
    other = keras.callbacks.History()
    kinds = (hvd_callbacks.LearningRateScheduleCallback,
             hvd_callbacks.LearningRateWarmupCallback)
    KerasRates(config, 2).adjust_callbacks([schedule, warmup, other], kinds)
    assert np.isclose(schedule.initial_lr, 0.1) and np.isclose(warmup.initial_lr, 0.1)
    untouched = hvd_callbacks.LearningRateScheduleCallback(initial_lr=9.0, multiplier=1.0)
    KerasRates(config, 1).adjust_callbacks([untouched], kinds)
    assert untouched.initial_lr == 9.0
