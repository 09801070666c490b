"""``DistributedOptimizer`` for TF1 optimizers (``tf.compat.v1.train.Optimizer``) in graphs.

``compute_gradients`` (and so ``minimize``) returns the wrapped optimizer's gradients
reduced across ranks; everything else is the wrapped optimizer's. Accumulating several
backward passes (``backward_passes_per_step > 1``) is for Keras optimizers only here.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hvd_spark.errors import ConfigError
from hvd_spark.tensorflow.gradients import GradientReducer


class LegacyDistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A TF1 optimizer whose gradients are reduced across ranks (Horovod's TF1 wrapper).

    Args:
        optimizer: The ``tf.compat.v1.train.Optimizer`` to wrap.
        reducer: How gradients are reduced (op, groups, process set, local variables).
        name: Name of the wrapper (default ``Distributed<Class>``).
        use_locking: As for any TF1 optimizer.
    """

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, reducer: GradientReducer,
                 name: str | None = None, use_locking: bool = False) -> None:
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}",
                         use_locking=use_locking)
        self._optimizer = optimizer
        self._reducer = reducer

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank (no allreduce)."""
        self._reducer.register_local_source(var)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's ``(gradient, variable)`` pairs, gradients reduced."""
        pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        if not pairs:
            return pairs
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        return list(zip(self._reducer.reduce(grads, variables), variables))

    def apply_gradients(self, *args: Any, **kwargs: Any) -> Any:
        """Apply (already reduced) gradients with the wrapped optimizer."""
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's slot."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> list[str]:
        """The wrapped optimizer's slot names."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's variables."""
        return self._optimizer.variables(*args, **kwargs)


def wrap_legacy(optimizer: tf.compat.v1.train.Optimizer, reducer: GradientReducer,
                name: str | None, use_locking: bool,
                backward_passes_per_step: int) -> LegacyDistributedOptimizer:
    """Wrap a TF1 optimizer; ``backward_passes_per_step`` must be 1."""
    if backward_passes_per_step != 1:
        raise ConfigError(
            "DistributedOptimizer: backward_passes_per_step > 1 needs a Keras optimizer "
            "(keras.optimizers.*); TF1 optimizers reduce at every step")
    return LegacyDistributedOptimizer(optimizer, reducer, name, use_locking)
