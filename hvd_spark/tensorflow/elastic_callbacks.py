"""Keras callbacks that keep an elastic state current during ``model.fit`` (Horovod's
``hvd.elastic.CommitStateCallback``, ``UpdateBatchStateCallback``, ``UpdateEpochStateCallback``).

List them in this order, so each commit sees the updated counters::

    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]

``commit()`` may raise ``HostsUpdatedInterrupt`` (workers wait to join); it leaves
``fit`` and reaches ``hvd.elastic.run``, which re-forms the ring and calls the training
function again.
"""

from __future__ import annotations

from typing import Any

import keras

from hvd_spark.errors import ConfigError


def _check_state(state: Any, where: str, *attrs: str) -> None:
    if not hasattr(state, "commit"):
        raise ConfigError(f"{where}: state must be an hvd.elastic state (with commit()), got "
                          f"{type(state).__name__}")
    missing = [a for a in attrs if not hasattr(state, a)]
    if missing:
        raise ConfigError(f"{where}: the state has no attribute {missing[0]!r}; create it "
                          f"with {missing[0]}=0, e.g. KerasState(model, epoch=0, batch=0)")


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of each epoch.

    Args:
        state: The elastic state to commit.
        batches_per_commit: Batches between two commits (a commit copies the model: fewer
            commits cost less, more lose less work when a rank is lost).
    """

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        _check_state(state, "CommitStateCallback")
        if (isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int)
                or batches_per_commit < 1):
            raise ConfigError("CommitStateCallback: batches_per_commit must be a positive "
                              f"integer, got {batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        # Every rank starts counting afresh after a reset, so all commit at the same batch.
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the last finished batch of the epoch (0 after each epoch).

    Keras 3 cannot shorten a running epoch from a callback, so after a reset in the middle
    of an epoch that epoch runs again in full from the last commit (as Horovod's callback
    does under TensorFlow 2); ``state.batch`` records where the lost one was.

    Args:
        state: An elastic state created with a ``batch`` attribute.
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        _check_state(state, "UpdateBatchStateCallback", "batch")
        self.state = state

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Count finished epochs in ``state.epoch`` across resets.

    Works whether the training function calls ``fit(epochs=total - state.epoch)``
    (Horovod's examples: Keras counts from 0 again) or ``fit(epochs=total,
    initial_epoch=state.epoch)``: the epochs finished in this ``fit`` are added to the
    value ``state.epoch`` had when it began.

    Args:
        state: An elastic state created with an ``epoch`` attribute.
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        _check_state(state, "UpdateEpochStateCallback", "epoch")
        self.state = state
        self.initial_epoch = state.epoch
        self._first_epoch: int | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = self.state.epoch
        self._first_epoch = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self._first_epoch is None:
            self._first_epoch = epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        first = epoch if self._first_epoch is None else self._first_epoch
        self.state.epoch = self.initial_epoch + (epoch - first) + 1
