"""Training state that ranks can sync, commit and restore (Horovod's ``hvd.elastic`` states).

``TensorFlowState`` (variables plus plain attributes such as ``epoch``/``batch``) and
``TensorFlowKerasState`` (a model and its optimizer) work as in Horovod: ``sync()`` makes
every rank take rank 0's values, ``commit()`` keeps a copy, ``restore()`` goes back to it.
The elastic *run loop* (re-forming the ring when hosts change) is not part of this
binding yet: a failure ends the job, and the launcher reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hvd_spark import collectives as C
from hvd_spark.tensorflow.functions import broadcast_variables


class ObjectState:
    """Plain attributes (given as keyword arguments) that are synced, committed and restored."""

    def __init__(self, **kwargs: Any) -> None:
        self._saved_attrs = dict(kwargs)
        self._reset_callbacks: list[Callable[[], None]] = []
        self._set_attrs()

    def register_reset_callbacks(self, callbacks: Sequence[Callable[[], None]]) -> None:
        """Functions to call after the job is reset (kept for Horovod compatibility)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks."""
        for callback in self._reset_callbacks:
            callback()

    def check_host_updates(self) -> None:
        """Horovod raises HostsUpdatedInterrupt here when hosts change; hosts are fixed here."""

    def commit(self) -> None:
        """Keep the current state as the one ``restore`` returns to."""
        self.save()
        self.check_host_updates()

    def save(self) -> None:
        """Copy the current attribute values."""
        self._saved_attrs = {k: getattr(self, k) for k in self._saved_attrs}

    def restore(self) -> None:
        """Go back to the last saved state."""
        self._set_attrs()

    def sync(self) -> None:
        """Make every rank take rank 0's attribute values."""
        if self._saved_attrs:
            self._saved_attrs = C.broadcast_object(self._saved_attrs, 0)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for key, value in self._saved_attrs.items():
            setattr(self, key, value)


class TensorFlowState(ObjectState):
    """A list of ``tf.Variable`` plus attributes (eager TensorFlow 2).

    Args:
        variables: The variables to track.
        session: Accepted for Horovod compatibility (TF1 sessions are not supported here).
        kwargs: Attributes to sync, exposed as attributes of the state.
    """

    def __init__(self, variables: Sequence[tf.Variable] | None = None, session: Any = None,
                 **kwargs: Any) -> None:
        del session
        self.variables = list(variables if variables is not None
                              else tf.compat.v1.global_variables())
        self._values = self._read()
        super().__init__(**kwargs)

    def _read(self) -> list[np.ndarray]:
        return [np.array(v.numpy(), copy=True) for v in self.variables]

    def save(self) -> None:
        """Copy the variables and attributes."""
        self._values = self._read()
        super().save()

    def restore(self) -> None:
        """Assign the saved values back to the variables; restore the attributes."""
        for var, value in zip(self.variables, self._values):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        """Broadcast rank 0's variables and attributes; the result becomes the saved state."""
        broadcast_variables(self.variables, root_rank=0)
        self._values = self._read()
        super().sync()


class TensorFlowKerasState(TensorFlowState):
    """A Keras model (and optimizer) plus attributes.

    Args:
        model: The Keras model whose variables are tracked.
        optimizer: Its optimizer (default ``model.optimizer``); its variables are tracked
            once it has built them.
        kwargs: Attributes to sync, exposed as attributes of the state.
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        variables = list(model.variables)
        if self.optimizer is not None:
            variables += list(self.optimizer.variables)
        super().__init__(variables, **kwargs)


#: Horovod's name in ``horovod.tensorflow.keras.elastic``.
KerasState = TensorFlowKerasState
