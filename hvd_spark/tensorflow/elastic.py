"""Elastic training for TensorFlow and Keras (Horovod's ``hvd.elastic`` in ``horovod.tensorflow``
and ``horovod.tensorflow.keras``).

``TensorFlowState(variables, **kwargs)`` keeps a list of variables, ``TensorFlowKerasState``
(alias ``KerasState``) a Keras model and its optimizer, each with plain attributes such as
``epoch=0, batch=0``. They are the framework-free :class:`~hvd_spark.collectives.elastic.State`
underneath: ``commit()`` saves and then checks for joining workers, ``restore()`` goes back
to the last commit, ``sync()`` takes rank 0's values, ``register_reset_callbacks`` runs
functions after each reset (rescale the learning rate there).

:func:`run` is the collectives' decorator plus one translation: a collective that fails
inside a ``tf.function`` (a Keras train step) reaches Python as a TensorFlow ``OpError``
whose message names our error, not as :class:`HorovodInternalError` itself; the decorator
recognises it and recovers as from any lost rank.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf

from hvd_spark.collectives import elastic as _core
from hvd_spark.collectives.elastic import ObjectState, State
from hvd_spark.errors import ConfigError, HorovodInternalError, PeerDisconnectedError
from hvd_spark.tensorflow.elastic_callbacks import (
    CommitStateCallback,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
)
from hvd_spark.tensorflow.functions import broadcast_variables

__all__ = [
    "CommitStateCallback", "KerasState", "ObjectState", "State", "TensorFlowKerasState",
    "TensorFlowState", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run",
]

F = TypeVar("F", bound=Callable[..., Any])

# How a graph kernel's Python exception reads inside TensorFlow's error message.
_LOST_IN_GRAPH = re.compile(r"\b(PeerDisconnectedError|HorovodInternalError): ([^\n]*)")


def lost_peer_error(exc: BaseException) -> HorovodInternalError | None:
    """The lost-rank error behind ``exc``, or None if ``exc`` is something else.

    Eager collectives raise :class:`HorovodInternalError` itself (perhaps as the cause of
    another error); graph collectives surface as a ``tf.errors.OpError`` whose message
    holds the original class name and text.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, HorovodInternalError):
            return current
        if isinstance(current, tf.errors.OpError):
            found = _LOST_IN_GRAPH.search(current.message or "")
            if found:
                cls = (PeerDisconnectedError if found.group(1) == "PeerDisconnectedError"
                       else HorovodInternalError)
                return cls(f"{found.group(2)} (raised inside a TensorFlow graph)")
        current = current.__cause__ or current.__context__
    return None


def run(func: F) -> F:
    """Decorate ``func(state, *args, **kwargs)`` to survive lost and joining ranks.

    As :func:`hvd_spark.collectives.elastic.run`, and a TensorFlow error that hides a
    lost rank (a collective inside ``model.fit`` or a ``tf.function``) counts as
    :class:`HorovodInternalError`: the last commit is restored, the ring re-forms among
    the survivors and ``func`` runs again.
    """
    @functools.wraps(func)
    def translated(state: State, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            lost = lost_peer_error(exc)
            if lost is None:
                raise
            raise lost from exc

    return _core.run(translated)  # type: ignore[return-value]


def _values(variables: Sequence[Any]) -> list[np.ndarray]:
    """Copies of the variables' values that later updates cannot change."""
    return [np.array(v.numpy(), copy=True) for v in variables]


def _assign(variables: Sequence[Any], values: Sequence[np.ndarray]) -> None:
    for var, value in zip(variables, values):
        var.assign(value)


def _require_eager(what: str) -> None:
    if not tf.executing_eagerly():
        raise ConfigError(f"{what} needs eager TensorFlow 2 (a TF1 graph/session is not "
                          "supported by elastic training); call it outside tf.function")


class TensorFlowState(ObjectState):
    """A list of ``tf.Variable`` plus plain attributes (eager TensorFlow 2).

    Args:
        variables: The variables to track (default: ``tf.compat.v1.global_variables()``).
        session: Accepted for Horovod compatibility; TF1 sessions are not supported.
        **kwargs: Attributes to keep, exposed as attributes of the state.
    """

    def __init__(self, variables: Sequence[tf.Variable] | None = None, session: Any = None,
                 **kwargs: Any) -> None:
        del session
        _require_eager("TensorFlowState")
        self.variables = list(variables if variables is not None
                              else tf.compat.v1.global_variables())
        self._values = _values(self.variables)
        super().__init__(**kwargs)

    def save(self) -> None:
        """Copy the variables and attributes."""
        self._values = _values(self.variables)
        super().save()

    def restore(self) -> None:
        """Assign the saved values back to the variables; restore the attributes."""
        _assign(self.variables, self._values)
        super().restore()

    def sync(self) -> None:
        """Broadcast rank 0's variables and attributes; the result becomes the saved state."""
        broadcast_variables(self.variables, root_rank=0, name="elastic.tf_state")
        self._values = _values(self.variables)
        super().sync()


class TensorFlowKerasState(ObjectState):
    """A built Keras model, its optimizer and plain attributes.

    The optimizer's slot variables are created now (``optimizer.build``) if training
    has not created them yet, so every rank, a newly joined one too, syncs the same list.
    After each reset the model's compiled train function is dropped, so the next
    ``fit`` traces it again for the new ring.

    Args:
        model: A built Keras model (call it once or ``model.build(input_shape)`` first).
        optimizer: Its optimizer (default ``model.optimizer``).
        backend: Accepted for Horovod compatibility (unused: Keras 3 needs no session).
        **kwargs: Attributes to keep, exposed as attributes of the state.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        del backend
        _require_eager("TensorFlowKerasState")
        if not getattr(model, "built", True):
            raise ConfigError(
                "TensorFlowKerasState: model is not built; call model.build(input_shape) or "
                "run it on a batch before creating the state")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        if self.optimizer is None:
            raise ConfigError("TensorFlowKerasState: no optimizer; pass optimizer= or "
                              "compile the model with one first")
        if not getattr(self.optimizer, "built", True) and hasattr(self.optimizer, "build"):
            self.optimizer.build(model.trainable_variables)
        self._model_values = _values(self.model.variables)
        self._optimizer_values = _values(self.optimizer.variables)
        super().__init__(**kwargs)

    def save(self) -> None:
        """Copy the model's and optimizer's variables and the attributes."""
        self._model_values = _values(self.model.variables)
        self._optimizer_values = _values(self.optimizer.variables)
        super().save()

    def restore(self) -> None:
        """Put the last saved model, optimizer and attributes back."""
        _assign(self.model.variables, self._model_values)
        _assign(self.optimizer.variables, self._optimizer_values)
        super().restore()

    def sync(self) -> None:
        """Make every rank take rank 0's model, optimizer and attributes."""
        broadcast_variables(self.model.variables, root_rank=0, name="elastic.keras_model")
        broadcast_variables(self.optimizer.variables, root_rank=0,
                            name="elastic.keras_optimizer")
        self._model_values = _values(self.model.variables)
        self._optimizer_values = _values(self.optimizer.variables)
        super().sync()

    def on_reset(self) -> None:
        """Forget what was traced for the old ring, then run the user's reset callbacks."""
        # A trace bakes in Python-time facts (the ring's size, a rank's place in it):
        # every rank, old or new, then runs a train step traced for this ring.
        if hasattr(self.model, "train_function"):
            self.model.train_function = None
        super().on_reset()


class KerasState(TensorFlowKerasState):
    """Horovod's ``hvd.elastic.KerasState(model, optimizer=None, **kwargs)``."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)
