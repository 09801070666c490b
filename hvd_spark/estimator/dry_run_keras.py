"""KerasEstimator's dry run (see ``hvd_spark.estimator.dry_run``): the model called on a few
rows (``training=False``) and the loss as ``compile`` resolves it, on the driver.

The user's model is only called, and only when it is built (a built model's call creates
no weights and, with ``training=False``, updates no state such as BatchNorm statistics).
"""

from __future__ import annotations

import logging
import math
import types
from typing import Any

import numpy as np

from hvd_spark.data.sample import Sample, describe
from hvd_spark.errors import ConfigError
from hvd_spark.estimator.dry_run import SKIP_HINT, received, values_per_row

log = logging.getLogger("hvd_spark.estimator")


def keras_check(estimator: Any, sample: Sample, batch: dict,
                label_shapes: list | None) -> None:
    """The Keras dry run; ConfigError naming the column, the model's input and the fix.

    ``label_shapes`` are the Estimator's checked ``label_shapes`` (batch shapes).
    """
    from hvd_spark.estimator.keras_worker import batch_xy, row_shapes

    model = estimator.value("model")
    inputs = getattr(model, "inputs", None) if getattr(model, "built", False) else None
    if not inputs:
        log.debug("dry run skipped: the Keras model is not built (no known inputs)")
        return
    features, labels = estimator.value("feature_cols"), estimator.value("label_cols")
    for col, tensor in zip(features, inputs):
        dims = tuple(tensor.shape[1:])
        size = values_per_row(batch[col])
        if None not in dims and math.prod(dims) != size:
            raise ConfigError(
                f"feature column {col!r} holds {size} values per row but the model input "
                f"{tensor.name!r} has shape {dims} ({math.prod(dims)} values); the column is "
                f"{sample.types.get(col, '?')}: select the feature column(s) the model was "
                f"built for, or build its input as keras.Input({(size,)}) (dry run)")
    out_shapes = ([tuple(s[1:]) for s in label_shapes] if label_shapes
                  else row_shapes(model.outputs))
    ds = types.SimpleNamespace(feature_cols=features, label_cols=labels,
                               sample_weight_col=estimator.value("sample_weight_col"))
    x, y, *weights = batch_xy(batch, ds, row_shapes(inputs), out_shapes)
    try:
        out = model(x, training=False)
    except Exception as exc:  # noqa: BLE001 - any failure here is a mismatch to explain
        raise ConfigError(
            f"the model failed on {sample.rows} sample rows on the driver (dry run): "
            f"{type(exc).__name__}: {exc}. It received "
            f"{received(sample, batch, features)}; its inputs: "
            f"{[(t.name, tuple(t.shape[1:]), str(t.dtype)) for t in inputs]}; {SKIP_HINT}") \
            from exc
    outputs = list(out) if isinstance(out, (list, tuple)) else [out]
    ys = list(y) if isinstance(y, tuple) else [y]
    names = list(getattr(model, "output_names", None) or [])
    weight = weights[0] if weights else None
    for i, (fn, y_true, y_pred, col) in enumerate(
            zip(_losses(estimator.value("loss"), names, len(outputs)), ys, outputs, labels)):
        if fn is None:
            continue
        try:
            loss = _resolved(fn, y_true, y_pred)
            np.asarray(loss(y_true, y_pred, sample_weight=weight))
        except Exception as exc:  # noqa: BLE001 - any failure here is a mismatch to explain
            raise ConfigError(_loss_message(fn, y_true, y_pred, sample, col, i, exc)) from exc


def _losses(loss: Any, output_names: list[str], count: int) -> list:
    """One loss identifier per output, as ``compile(loss=...)`` takes them."""
    if isinstance(loss, dict):
        return [loss.get(name) for name in output_names] if output_names else [None] * count
    if isinstance(loss, (list, tuple)):
        return list(loss)
    return [loss] * count


def _resolved(identifier: Any, y_true: Any, y_pred: Any) -> Any:
    """The Loss object ``compile`` makes of ``identifier`` ("crossentropy" picks by shape)."""
    try:
        from keras.src.trainers.compile_utils import get_loss
    except ImportError:  # another Keras layout: the public lookup, wrapped the same way
        import keras

        loss = keras.losses.get(identifier)
        return loss if isinstance(loss, keras.losses.Loss) \
            else keras.losses.LossFunctionWrapper(loss)
    return get_loss(identifier, y_true, y_pred)


def _name(identifier: Any) -> str:
    if isinstance(identifier, str):
        return identifier
    return getattr(identifier, "name", None) or getattr(identifier, "__name__", None) \
        or type(identifier).__name__


def _loss_message(identifier: Any, y_true: Any, y_pred: Any, sample: Sample, col: str,
                  index: int, exc: Exception) -> str:
    name = _name(identifier)
    error = f"{type(exc).__name__}: {exc}"
    head = f"the loss failed on {sample.rows} sample rows on the driver (dry run)"
    width = int(np.prod(tuple(y_pred.shape)[1:]))
    per_row = values_per_row(np.asarray(y_true))
    lowered = name.lower().replace(" ", "_")
    if "categorical_crossentropy" in lowered and "sparse" not in lowered \
            and per_row == 1 and width > 1:
        return (f"label column {describe(sample, col)} holds one class index per row, but "
                f"{name} wants one-hot rows of {width}: pass "
                f"loss='sparse_categorical_crossentropy', or one-hot the labels ({head}: "
                f"{error})")
    if "sparse_categorical_crossentropy" in lowered and per_row == width and width > 1:
        return (f"label column {describe(sample, col)} holds {per_row} values per row "
                f"(one-hot?), but {name} wants one class index per row: pass "
                f"loss='categorical_crossentropy', or give the class index ({head}: {error})")
    return (f"{head}: {error}. Output {index} ({name}): label {describe(sample, col)} as "
            f"{np.asarray(y_true).dtype} {tuple(np.shape(y_true))} vs model output "
            f"{getattr(y_pred.dtype, 'name', y_pred.dtype)} {tuple(y_pred.shape)}. Labels "
            f"are reshaped to label_shapes (default: the output's shape) when they hold as "
            f"many values; {SKIP_HINT}")
