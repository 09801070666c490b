"""The KerasEstimator's side of Horovod's learning-rate rule (see ``learning_rate``).

Imported by the Keras worker only, inside a rank: it needs Keras. A float rate is
multiplied in place; a ``LearningRateSchedule`` is wrapped in ``ScaledSchedule`` (Horovod
reads the rate with ``get_value`` and fails on a schedule), registered with Keras so a
checkpoint callback can save the model with its optimizer.
"""

from __future__ import annotations

import copy
from typing import Any

import keras
import numpy as np

from hvd_spark.estimator.learning_rate import unscale


@keras.saving.register_keras_serializable(package="hvd_spark")
class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """``schedule(step) * factor``.

    Args:
        schedule: The user's schedule.
        factor: The number of ranks.
    """

    def __init__(self, schedule: Any, factor: float) -> None:
        self.schedule = schedule
        self.factor = float(factor)

    def __call__(self, step: Any) -> Any:
        return self.schedule(step) * self.factor

    def get_config(self) -> dict:
        return {"schedule": keras.optimizers.schedules.serialize(self.schedule),
                "factor": self.factor}

    @classmethod
    def from_config(cls, config: dict) -> ScaledSchedule:
        return cls(keras.optimizers.schedules.deserialize(config["schedule"]), config["factor"])


class KerasRates:
    """A Keras optimizer (before ``DistributedOptimizer`` rebuilds it from its config)
    trained at ``factor`` times the user's rate.

    Args:
        config: The user's optimizer, serialized (``keras.optimizers.serialize``).
        factor: The number of ranks (1: the optimizer as given).
    """

    def __init__(self, config: dict, factor: int) -> None:
        self.config = config
        self.factor = factor
        self.optimizer = keras.optimizers.deserialize(copy.deepcopy(config))
        # The private slot tells a schedule from a float (the property evaluates schedules).
        rate = self.optimizer._learning_rate
        self.schedule = isinstance(rate, keras.optimizers.schedules.LearningRateSchedule)
        self.base = None if self.schedule else float(np.asarray(self.optimizer.learning_rate))
        if factor == 1:
            return
        if self.schedule:
            settings = self.optimizer.get_config()
            settings["learning_rate"] = ScaledSchedule(rate, factor)
            self.optimizer = type(self.optimizer).from_config(settings)
        else:
            self.optimizer.learning_rate = self.base * factor

    @property
    def scaled(self) -> float | None:
        """The rate the rank starts with (None for a schedule)."""
        return None if self.base is None else self.base * self.factor

    def user_rate(self, optimizer: Any) -> float | None:
        """The user's rate behind ``optimizer``'s current float rate (None: a schedule)."""
        if self.schedule:
            return None
        return unscale(float(np.asarray(optimizer.learning_rate)), self.base, self.factor)

    def restore(self, optimizer: Any, user_rate: float | None) -> None:
        """After a resume has assigned every optimizer variable (the rate among them, as
        the last run's ranks had it): the checkpoint's user rate times this run's factor."""
        if not self.schedule and user_rate is not None:
            optimizer.learning_rate = user_rate * self.factor

    def unscaled_config(self, optimizer: Any) -> dict:
        """The user's optimizer config with the trained rate unscaled (what the model keeps)."""
        config = copy.deepcopy(self.config)
        if not self.schedule:
            config["config"]["learning_rate"] = self.user_rate(optimizer)
        return config

    def adjust_callbacks(self, callbacks: list, rate_callbacks: tuple[type, ...]) -> None:
        """Horovod sets its learning-rate callbacks' ``initial_lr`` to the scaled rate."""
        if self.factor == 1 or self.scaled is None:
            return
        for callback in callbacks:
            if isinstance(callback, rate_callbacks):
                callback.initial_lr = self.scaled
