"""Horovod's learning-rate rule for the Torch and Keras Estimators, in one place.

Horovod's ``TorchEstimator`` and ``KerasEstimator`` train with the optimizer's learning
rate multiplied by the number of ranks (the linear scaling rule of Goyal et al.: the
global batch is ``num_proc`` times the per-rank ``batch_size``). What they save carries
the user's rate, so a resumed or re-fitted run scales from it again and never twice.
hvd_spark does the same by default; ``scale_learning_rate=False`` keeps the rate as
given. The ranks scale by the size of the job they are in, so after a recovery on fewer
ranks the rate follows the new size.

The ``learning_rate`` Param (hvd_spark only; snake_case as every Param of the package)
replaces the optimizer's own rate so that a tuning grid can search it
(``ParamGridBuilder().addGrid(est.learning_rate, [...])``). It applies to a copy of the
user's optimizer, before the rule above: the ranks train at ``learning_rate x num_proc``
unless ``scale_learning_rate=False``. None (the default) keeps the optimizer's rate.

No framework is imported here: the functions take the framework's objects and plain
numbers, and the driver-side message needs neither.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from hvd_spark.errors import ConfigError

#: Name of the Param that turns the rule off (the Torch and Keras Estimators have it).
PARAM = "scale_learning_rate"

#: Its Param spec (name, doc, converter, default), as ``params.define_params`` takes it.
PARAM_SPEC: tuple[str, str, Any, Any] = (
    PARAM, "train with the optimizer's learning rate x the number of ranks, as Horovod "
    "does (saved models and checkpoints keep the rate as given); False: use it as given; "
    "hvd_spark only", None, True)


#: Name of the Param that replaces the optimizer's rate (Torch and Keras Estimators).
RATE = "learning_rate"

#: Its Param spec (name, doc, converter, default).
RATE_SPEC: tuple[str, str, Any, Any] = (
    RATE, "learning rate replacing the optimizer's own (every torch param group's; a Keras "
    "rate or schedule), before Horovod's x num_proc rule; None: the optimizer's own; "
    "hvd_spark only", None, None)


def check_rate(rate: Any) -> None:
    """Raise ConfigError unless ``rate`` is None or a finite number > 0."""
    if rate is None:
        return
    if (isinstance(rate, bool) or not isinstance(rate, (int, float))
            or not math.isfinite(rate) or rate <= 0):
        raise ConfigError(f"{RATE} must be a finite number > 0 (or None: the optimizer's own "
                          f"rate), got {rate!r}")


def torch_at_rate(optimizer: Any, rate: float | None) -> Any:
    """``optimizer``, or a copy of it whose every param group trains at ``rate``.

    The copy shares the parameters and the state with the user's optimizer (pickled
    together with the model, it still refers to the model's parameters); its param
    groups and defaults are new dicts, so the user's optimizer is never changed.
    """
    if rate is None:
        return optimizer
    rate = float(rate)
    # copy.copy goes through Optimizer.__getstate__/__setstate__, as pickling does.
    out = copy.copy(optimizer)
    out.defaults = {**optimizer.defaults, "lr": rate}
    out.param_groups = [
        {**group, "lr": rate, **({"initial_lr": rate} if "initial_lr" in group else {})}
        for group in optimizer.param_groups]
    return out


def keras_at_rate(config: dict, rate: float | None) -> dict:
    """A serialized Keras optimizer (``keras.optimizers.serialize``) with ``rate`` as its
    learning rate (a schedule is replaced); ``config`` itself when ``rate`` is None."""
    if rate is None:
        return config
    out = copy.deepcopy(config)
    out.setdefault("config", {})["learning_rate"] = float(rate)
    return out


def unscale(rate: float, base: float, factor: int) -> float:
    """The user's rate behind a rank's ``rate``: ``base`` exactly when the rate is still
    ``base * factor`` (dividing back may round, e.g. 0.01 * 3 / 3; Keras keeps the rate in
    float32), else ``rate / factor`` (something changed the rate during training)."""
    if factor == 1 or math.isclose(rate, base * factor, rel_tol=1e-6):
        return base
    return rate / factor


def describe(rates: list[float] | None, num_proc: int, scale: bool, who: str) -> str:
    """The driver's one line at fit start: what the ranks train with, and how to change it.

    Args:
        rates: The optimizer's learning rates (one per torch param group), or None when
            the rate is a schedule.
        num_proc: Ranks the fit starts.
        scale: The ``scale_learning_rate`` Param.
        who: The estimator's class name.
    """
    def show(values: list[float]) -> str:
        text = [f"{v:.6g}" for v in values]
        return text[0] if len(set(text)) == 1 else "[" + ", ".join(text) + "]"

    if not scale:
        what = "the schedule's rates" if rates is None else f"learning rate {show(rates)}"
        return (f"{who}: {what} as given on each of {num_proc} rank(s) ({PARAM}=False; "
                f"Horovod would multiply it by {num_proc})")
    if rates is None:
        return (f"{who}: learning-rate schedule x {num_proc} rank(s), as Horovod does; "
                f"set {PARAM}=False to keep the schedule's rates")
    scaled = [r * num_proc for r in rates]
    return (f"{who}: learning rate {show(rates)} x {num_proc} rank(s) = {show(scaled)}, as "
            f"Horovod does; set {PARAM}=False to keep {show(rates)}")


class TorchRates:
    """A torch optimizer's param groups trained at ``factor`` times the user's rates.

    Args:
        optimizer: The optimizer, holding the user's (unscaled) rates; scaled in place.
        factor: The number of ranks (1: nothing changes).
    """

    def __init__(self, optimizer: Any, factor: int) -> None:
        self.optimizer = optimizer
        self.factor = factor
        self.base = [group["lr"] for group in optimizer.param_groups]
        for group, base in zip(optimizer.param_groups, self.base):
            group["lr"] = base * factor
            # A scheduler built before fit keeps its base rate here: it sees the scaled one.
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * factor

    def unscaled_state(self) -> dict:
        """``optimizer.state_dict()`` with the user's rates (what checkpoints and the fitted
        model carry). The param-group dicts of a state dict are fresh copies."""
        state = self.optimizer.state_dict()
        for group, base in zip(state["param_groups"], self.base):
            group["lr"] = unscale(group["lr"], base, self.factor)
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] / self.factor
        return state


def keras_rate(config: dict) -> float | None:
    """The float learning rate of a serialized Keras optimizer, None for a schedule."""
    rate = config.get("config", {}).get("learning_rate")
    return float(rate) if isinstance(rate, (int, float)) else None
