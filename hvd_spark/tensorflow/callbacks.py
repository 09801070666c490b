"""Keras callbacks for data-parallel training: broadcast, metric averaging, LR schedules,
best-model checkpoints."""

from __future__ import annotations

import logging
from typing import Any

import keras
import numpy as np

from hvd_spark import collectives as C
from hvd_spark.errors import ConfigError
from hvd_spark.tensorflow.functions import broadcast_variables, check_same_everywhere

__all__ = [
    "BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
    "LearningRateWarmupCallback", "MetricAverageCallback",
]

log = logging.getLogger(__name__)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Make every rank start from root's model and optimizer state.

    Broadcasts at the start of training (``model.fit`` builds the optimizer before
    that, so the first step already uses identical weights) and again after the
    first batch if the optimizer created variables lazily in the meantime.

    Args:
        root_rank: The rank whose state the others take.
        device: Accepted for Horovod compatibility; ignored.
        local_variables: Variables that keep each rank's own value (model-parallel
            parts); every rank must pass the same number of them.
    """

    def __init__(self, root_rank: int, device: str = "",
                 local_variables: list | None = None) -> None:
        super().__init__()
        del device
        self.root_rank = int(root_rank)
        self._local = {id(v) for v in local_variables or ()}
        self._done_with: int | None = None

    def _variables(self) -> list:
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            # Gradient accumulators (backward_passes_per_step > 1) hold this rank's own
            # gradients of the current step, which the reduction averages: never root's.
            inner = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer
            own = {id(v) for opt in (optimizer, inner)
                   for v in getattr(opt, "_accumulated_gradients", None) or ()}
            variables += [v for v in optimizer.variables if id(v) not in own]
        return [v for v in variables if id(v) not in self._local]

    def _broadcast(self) -> None:
        variables = self._variables()
        broadcast_variables(variables, self.root_rank, name="BroadcastGlobalVariablesCallback")
        self._done_with = len(variables)

    def on_train_begin(self, logs: dict | None = None) -> None:
        if C.size() > 1:
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # Optimizers that build at their first apply get their slots here.
        if C.size() > 1 and self._done_with is not None and batch == 0:
            if len(self._variables()) != self._done_with:
                self._broadcast()
            self._done_with = -1  # checked once per fit


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace the epoch metrics in the logs by their average over all ranks.

    Put it before callbacks that read the metrics (checkpoints, early stopping);
    ``model.fit``'s History and progress bar always come after it.

    Args:
        device: Accepted for Horovod compatibility; ignored.
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()
        del device

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is None or C.size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if _is_number(v))
        check_same_everywhere(keys, f"MetricAverageCallback.keys.{epoch}", "MetricAverageCallback")
        values = np.array([float(logs[k]) for k in keys], np.float64)
        averaged = C.allreduce(values, f"MetricAverageCallback.values.{epoch}", C.Average)
        for key, value in zip(keys, averaged.tolist()):
            logs[key] = value


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return np.ndim(value) == 0


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` (Goyal et al.).

    At each batch of the first ``warmup_epochs`` epochs the rate is
    ``initial_lr / size * (e * (size - 1) / warmup_epochs + 1)`` with ``e`` the
    fractional epoch; afterwards it is left alone. With ``momentum_correction``, the
    momentum buffers of SGD are scaled by new_lr / old_lr whenever the rate changes,
    which is Goyal et al.'s correction (Keras 3 compiles the momentum coefficient into
    the step as a constant, so the buffers are what can change per batch).

    Args:
        initial_lr: The target (already size-scaled) learning rate.
        warmup_epochs: Number of epochs to ramp over.
        momentum_correction: Apply the momentum correction.
        steps_per_epoch: Batches per epoch; taken from ``model.fit``'s params if None.
        verbose: 1 logs the rate at the end of warmup.
    """

    def __init__(self, initial_lr: float, warmup_epochs: float = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        super().__init__()
        if warmup_epochs <= 0:
            raise ConfigError(f"warmup_epochs must be > 0, got {warmup_epochs}")
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._epoch = 0

    def _optimizer(self):
        optimizer = self.model.optimizer
        if isinstance(getattr(optimizer, "_learning_rate", None),
                      keras.optimizers.schedules.LearningRateSchedule):
            raise ConfigError(
                "LearningRateWarmupCallback needs a float learning rate, not a "
                "LearningRateSchedule; put the warmup into the schedule instead")
        return optimizer

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.steps_per_epoch:
            raise ConfigError(
                "LearningRateWarmupCallback: pass steps_per_epoch (model.fit did not say)")
        self._optimizer()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def _lr_at(self, epoch: float) -> float:
        size = C.size()
        return self.initial_lr / size * (epoch * (size - 1) / self.warmup_epochs + 1)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        epoch = self._epoch + batch / self.steps_per_epoch
        if epoch > self.warmup_epochs:
            return
        new = self._lr_at(epoch)
        set_learning_rate(self._optimizer(), new, self.momentum_correction)
        if self.verbose and epoch + 1.0 / self.steps_per_epoch > self.warmup_epochs:
            log.info("epoch %d: finished learning-rate warmup at %g", self._epoch, new)


def set_learning_rate(optimizer: Any, new: float, momentum_correction: bool) -> None:
    """Set a float learning rate; with ``momentum_correction`` scale SGD's momentum buffers.

    Keras 3 compiles the momentum coefficient into the step as a constant, so Goyal et
    al.'s correction (momentum * new_lr / old_lr for the changing step) is applied to the
    buffers instead, which has the same effect on the next update.
    """
    old = float(np.asarray(optimizer.learning_rate))
    optimizer.learning_rate = new
    if momentum_correction and old > 0 and new != old:
        for buffer in getattr(optimizer, "momentums", None) or []:
            buffer.assign(buffer * (new / old))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` between two epochs.

    Args:
        initial_lr: The base (already size-scaled) learning rate.
        multiplier: A constant (exponential decay: ``multiplier ** (epoch - start_epoch)``)
            or a function of the (fractional, unless ``staircase``) epoch.
        start_epoch: First epoch of the schedule.
        end_epoch: The epoch it stops before (None: never).
        staircase: Change the rate at epoch starts only; else at every batch.
        momentum_correction: Scale SGD's momentum buffers when the rate changes.
        steps_per_epoch: Batches per epoch (needed without staircase); taken from
            ``model.fit``'s params if None.
    """

    def __init__(self, initial_lr: float, multiplier: Any, start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ConfigError("LearningRateScheduleCallback: initial_lr is required")
        self.initial_lr = float(initial_lr)
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor ** (epoch - start_epoch)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ConfigError("LearningRateScheduleCallback: pass steps_per_epoch "
                                  "(model.fit did not say)")

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._epoch < self.start_epoch or (
                self.end_epoch is not None and self._epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set(self._epoch)
        else:
            self._set(self._epoch + batch / self.steps_per_epoch)

    def _set(self, epoch: float) -> None:
        set_learning_rate(self.model.optimizer, self.initial_lr * self.multiplier(epoch),
                          self.momentum_correction)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keep only the best model so far (``ModelCheckpoint`` with ``save_best_only``).

    Horovod's Spark estimators set ``filepath`` themselves; elsewhere pass it (or set the
    ``filepath`` attribute before training).
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto",
                 save_freq: Any = "epoch", filepath: str | None = None) -> None:
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath or placeholder, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only,
                         mode=mode, save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.filepath:
            raise ConfigError("BestModelCheckpoint: set filepath (the file the best model "
                              "goes to) before training")
        super().on_train_begin(logs)
