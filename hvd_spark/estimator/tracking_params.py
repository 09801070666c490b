"""A fit's params as MLflow shows them: readable names and values, not repr strings.

``optimizer``: ``SGD`` with ``optimizer.lr``: ``0.05`` and its other numeric settings;
``model``: ``Sequential`` with ``model_parameters``: ``49``; ``loss``: ``MSELoss`` or
``mse_loss``; lists joined (``feature_cols``: ``a, b``), shapes as JSON, a Store as its URL,
any other object as its class name.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from typing import Any

_MAX_VALUE = 500  # characters of a logged param value (MLflow allows 6000)
# Torch optimizer settings that say how it runs, not what it does.
_OPTIMIZER_NOISE = {"params", "foreach", "fused", "capturable", "differentiable", "maximize",
                    "initial_lr", "name", "decoupled_weight_decay", "use_ema"}


def readable(value: Any) -> Any:
    """A param value as a person reads it: numbers and strings as they are, names of
    functions and classes, the class name of other objects, lists joined."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [readable(v) for v in value]
        if any(isinstance(v, (list, tuple)) for v in value):
            return json.dumps(value, default=lambda v: readable(v))  # shapes: [[-1, 4]]
        return ", ".join(str(v) for v in items)
    if isinstance(value, dict):
        return ", ".join(f"{k}={readable(v)}" for k, v in value.items())
    if isinstance(value, functools.partial):
        return readable(value.func)
    if inspect.isroutine(value) or inspect.isclass(value):
        return getattr(value, "__name__", None) or repr(value)
    url = getattr(value, "url", None)
    if isinstance(url, str):  # a Store
        return url
    return type(value).__name__


def _scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float)) or (
        isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float))
                                                            for v in value))


def model_params(model: Any) -> dict[str, Any]:
    """``model``: its class name; ``model_parameters``: how many numbers it trains."""
    out: dict[str, Any] = {"model": type(model).__name__}
    try:
        if callable(getattr(model, "count_params", None)):  # Keras
            out["model_parameters"] = int(model.count_params())
        elif callable(getattr(model, "parameters", None)):  # torch, Lightning
            out["model_parameters"] = sum(int(p.numel()) for p in model.parameters())
    except Exception:  # noqa: BLE001 - an unbuilt Keras model has no count yet
        pass
    return out


def optimizer_params(optimizer: Any) -> dict[str, Any]:
    """``optimizer``: its class name, and its numeric settings as ``optimizer.<name>``
    (a torch optimizer's first param group, a Keras optimizer's config)."""
    out: dict[str, Any] = {"optimizer": type(optimizer).__name__}
    settings: dict[str, Any] = {}
    groups = getattr(optimizer, "param_groups", None)
    if groups:  # torch
        settings = dict(groups[0])
        if len(groups) > 1:
            out["optimizer.param_groups"] = len(groups)
    elif callable(getattr(optimizer, "get_config", None)):  # Keras
        with contextlib.suppress(Exception):
            # float32 variables: 0.001, not 0.0010000000474974513
            settings = {k: float(f"{v:.7g}") if isinstance(v, float) else v
                        for k, v in optimizer.get_config().items()}
    for key, value in settings.items():
        if key in _OPTIMIZER_NOISE or value is None or key.startswith("ema_"):
            continue
        if _scalar(value):
            out[f"optimizer.{key}"] = readable(value)
        elif isinstance(value, dict) and "class_name" in value:  # a Keras schedule
            out[f"optimizer.{key}"] = value["class_name"]
    return out


def estimator_params(estimator: Any) -> dict[str, Any]:
    """The Estimator's params (set or default, not None) as readable names and values.

    Params that do nothing for the class (Horovod's petastorm knobs) are left out.
    """
    ignored = set(estimator._ignored()) | {"mlflow"}
    out: dict[str, Any] = {}
    for param, value in estimator.extractParamMap().items():
        name = param.name
        if value is None or name in ignored:
            continue
        if name == "model":
            out.update(model_params(value))
        elif name == "optimizer":
            out.update(optimizer_params(value))
        else:
            out[name] = readable(value)
    return {k: _short(v) for k, v in sorted(out.items())}


def _short(value: Any) -> Any:
    text = str(value)
    return value if len(text) <= _MAX_VALUE else text[: _MAX_VALUE - 3] + "..."
