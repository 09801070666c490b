"""The Estimators' dry run: the model and the loss on a few rows, on the driver, before
any data is written.

A float label with ``CrossEntropyLoss``, or a model whose input width differs from the
feature column, would otherwise fail only after the data is written and the ranks have
started, with a raw framework error. ``check`` takes ``ROWS`` rows (one small Spark job),
converts them exactly as the ranks' reader will (``hvd_spark.data.sample``), applies
``transformation_fn``, and runs on the driver's CPU:

- TorchEstimator: the forward pass of a copy of the model (eval mode, no gradients), the
  loss as the training loop computes it, and the metrics. With ``train_minibatch_fn``,
  only the forward pass (the function may compute the loss its own way).
- KerasEstimator: ``model(x, training=False)`` and the loss (when the model is built).
- LightningEstimator: the forward pass only (``training_step`` may need a Trainer); the
  ranks call the forward pass on the features too, when they record the output shapes.

What fails becomes a ``ConfigError`` that names the column, its type and shape, what the
model expected, and the fix. The user's model, optimizer and loss are never changed:
the torch model is copied, and Keras only calls an already built model. ``dry_run=False``
skips it, for a model too big to copy or run on the driver. ``fit_on_parquet`` has no
DataFrame and no dry run.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from hvd_spark.data.sample import Sample, describe, sample_rows
from hvd_spark.errors import ConfigError
from hvd_spark.estimator.train_spec import apply_transformation, batch_shape

log = logging.getLogger("hvd_spark.estimator")

#: Name of the Param (Torch, Keras and Lightning Estimators).
PARAM = "dry_run"

#: Its Param spec (name, doc, converter, default), as ``params.define_params`` takes it.
PARAM_SPEC: tuple[str, str, Any, Any] = (
    PARAM, "before writing any data, run the model (and the loss) on a few rows on the "
    "driver's CPU, so that columns and model that do not fit fail at once with a clear "
    "message; False skips it (models too big for the driver); hvd_spark only", None, True)

#: Rows in the sample batch.
ROWS = 8

#: The end of every dry-run error: how to skip the check.
SKIP_HINT = "dry_run=False skips this check (e.g. for a model too big for the driver)"


def check(estimator: Any, df: Any) -> None:
    """The dry run of ``estimator`` on ``df`` when its ``dry_run`` Param is on.

    Raises:
        ConfigError: The model, loss or metrics fail on the sample rows.
        DataError: A column is missing or of a type that cannot be stored.
    """
    if not estimator.hasParam(PARAM):
        return
    enabled = estimator.value(PARAM)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{PARAM} must be True or False, got {enabled!r}")
    if not enabled:
        return
    started = time.perf_counter()
    weight = estimator.value("sample_weight_col")
    sample = sample_rows(df, [*estimator.value("feature_cols"), *estimator.value("label_cols"),
                              *([weight] if weight else [])], ROWS)
    if sample is None:
        return  # nulls, empty, ragged arrays: write_dataset says so in its own words
    batch = transformed(estimator, sample)
    estimator._dry_run(sample, batch)
    log.debug("dry run on %d rows: %.3f s", sample.rows, time.perf_counter() - started)


def transformed(estimator: Any, sample: Sample) -> dict:
    """The sample batch after ``transformation_fn``, as the ranks apply it."""
    fn = estimator.value("transformation_fn")
    if fn is None:
        return dict(sample.batch)
    try:
        return apply_transformation(fn, dict(sample.batch))
    except Exception as exc:  # noqa: BLE001 - the user's function: say which one failed
        raise ConfigError(
            f"transformation_fn failed on {sample.rows} sample rows on the driver (dry run): "
            f"{type(exc).__name__}: {exc}. It gets a dict of column -> numpy array, rows "
            f"first; {SKIP_HINT}") from exc


def received(sample: Sample, batch: dict, columns: list[str]) -> str:
    """``'features' (vector) as float32 (8, 4)``, one entry per column, for messages."""
    parts = []
    for col in columns:
        value = batch.get(col)
        got = (f" as {_dtype_name(value)} {tuple(value.shape)}" if hasattr(value, "shape")
               else "")
        parts.append(describe(sample, col) + got)
    return ", ".join(parts)


def _dtype_name(value: Any) -> str:
    return str(value.dtype).replace("torch.", "")


def values_per_row(value: Any) -> int:
    """Values in one row of a batch array or tensor (rows first)."""
    return math.prod(tuple(value.shape)[1:])


# ------------------------------------------------------------------------------ torch


def torch_model_copy(model: Any) -> Any:
    """A CPU copy of ``model`` in eval mode; the user's model is left as it is."""
    import copy

    import cloudpickle

    try:
        clone = copy.deepcopy(model)
    except Exception:  # noqa: BLE001 - what does not deep-copy may still pickle
        clone = cloudpickle.loads(cloudpickle.dumps(model))
    return clone.cpu().eval()


def first_layer(model: Any) -> Any:
    """The first registered module that holds parameters itself (None: none)."""
    for module in model.modules():
        if next(module.children(), None) is None and next(module.parameters(False), None) \
                is not None:
            return module
    return None


def torch_forward(model: Any, inputs: list, sample: Sample, batch: dict,
                  feature_cols: list[str]) -> Any:
    """``model(*inputs)`` under no_grad, or a ConfigError saying why it does not fit."""
    import torch

    try:
        with torch.no_grad():
            return model(*inputs)
    except Exception as exc:  # noqa: BLE001 - any failure here is a mismatch to explain
        raise ConfigError(_forward_message(model, inputs, sample, batch, feature_cols, exc)) \
            from exc


def _forward_message(model: Any, inputs: list, sample: Sample, batch: dict,
                     feature_cols: list[str], exc: Exception) -> str:
    import torch

    layer = first_layer(model)
    head = f"the model failed on {sample.rows} sample rows on the driver (dry run)"
    error = f"{type(exc).__name__}: {exc}"
    if layer is not None and len(inputs) == 1:
        col, x = feature_cols[0], inputs[0]
        width = int(x.shape[-1]) if x.dim() else 1
        if isinstance(layer, torch.nn.Linear) and width != layer.in_features:
            return (f"feature column {col!r} holds {values_per_row(x)} values per row but "
                    f"the model's first layer {layer} expects {layer.in_features}; the column "
                    f"is {sample.types.get(col, '?')}, a {_dtype_name(x)} tensor of shape "
                    f"{tuple(x.shape)} for the model: select the feature column(s) the model "
                    f"was built for, or build its first layer with in_features={width} "
                    f"({head}: {error})")
        if isinstance(layer, (torch.nn.Embedding, torch.nn.EmbeddingBag)) \
                and x.is_floating_point():
            return (f"feature column {describe(sample, col)} reaches the model as "
                    f"{_dtype_name(x)}, but its first layer {layer} takes integer ids: cast "
                    f"the column (df.withColumn({col!r}, F.col({col!r}).cast('long'))) "
                    f"({head}: {error})")
        conv = {torch.nn.Conv1d: 3, torch.nn.Conv2d: 4, torch.nn.Conv3d: 5}
        wanted = conv.get(type(layer))
        if wanted is not None and x.dim() != wanted:
            return (f"feature column {describe(sample, col)} reaches the model as shape "
                    f"{tuple(x.shape)}, but its first layer {layer} takes {wanted}-d batches "
                    f"(rows, {layer.in_channels} channels, ...): give input_shapes, e.g. "
                    f"[[-1, {layer.in_channels}, ...]], to reshape each row ({head}: {error})")
    params = next(model.parameters(), None)
    expects = f"; its first layer is {layer}" if layer is not None else ""
    dtype = f" and parameters of {_dtype_name(params)}" if params is not None else ""
    return (f"{head}: {error}. It received {received(sample, batch, feature_cols)} "
            f"(reshaped by input_shapes when given: {[tuple(i.shape) for i in inputs]}), "
            f"and has {type(model).__name__}{dtype}{expects}. Check feature_cols (their order "
            f"is the forward arguments' order), input_shapes and the model's first layer; "
            f"{SKIP_HINT}")


def torch_loss(loss_fn: Any, losses: list, outputs: tuple, labels: list,
               row_weights: Any, sample: Sample, batch: dict, label_cols: list[str]) -> None:
    """The training loop's loss on the sample, or a ConfigError saying how to fix it."""
    import torch

    try:
        with torch.no_grad():
            value = loss_fn(outputs, labels, row_weights)
    except Exception as exc:  # noqa: BLE001 - any failure here is a mismatch to explain
        raise ConfigError(_loss_message(losses, outputs, labels, sample, batch, label_cols,
                                        exc)) from exc
    numel = value.numel() if hasattr(value, "numel") else 1
    if numel != 1:
        raise ConfigError(
            f"the loss returns {numel} values on {sample.rows} sample rows (dry run), not "
            "one: training needs a scalar (use reduction='mean'; with sample_weight_col a "
            "loss function gets reduction='none' and the weighted mean is taken for you)")


def _class_index_loss(fn: Any) -> str | None:
    """``cross_entropy``/``nll_loss`` for losses that take class indices, else None."""
    import torch
    import torch.nn.functional as F  # noqa: N812 - torch's own convention

    if isinstance(fn, torch.nn.CrossEntropyLoss) or fn is F.cross_entropy:
        return "cross_entropy"
    if isinstance(fn, torch.nn.NLLLoss) or fn is F.nll_loss:
        return "nll_loss"
    return None


def _loss_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _loss_message(losses: list, outputs: tuple, labels: list, sample: Sample, batch: dict,
                  label_cols: list[str], exc: Exception) -> str:
    error = f"{type(exc).__name__}: {exc}"
    head = f"the loss failed on {sample.rows} sample rows on the driver (dry run)"
    for fn, out, label, col in zip(losses, outputs, labels, label_cols):
        functional = _class_index_loss(fn)
        if functional is None or out.dim() != label.dim() + 1:
            continue
        if label.is_floating_point():
            return (f"label column {col!r} is {sample.types.get(col, '?')}; "
                    f"{_loss_name(fn)} wants integer class indices: cast the column "
                    f"(df.withColumn({col!r}, F.col({col!r}).cast('long'))), or pass "
                    f"loss=lambda out, y: F.{functional}(out, y.long()) ({head}: {error})")
        classes = int(out.shape[1])
        if label.numel() and (int(label.min()) < 0 or int(label.max()) >= classes):
            return (f"label column {describe(sample, col)} holds class indices from "
                    f"{int(label.min())} to {int(label.max())}, but the model outputs "
                    f"{classes} classes (0 to {classes - 1}): index the labels from 0 (e.g. "
                    f"StringIndexer) or give the model's last layer more outputs ({head}: "
                    f"{error})")
    pairs = "; ".join(
        f"label {describe(sample, col)} as {_dtype_name(label)} {tuple(label.shape)} vs "
        f"output {_dtype_name(out)} {tuple(out.shape)} ({_loss_name(fn)})"
        for fn, out, label, col in zip(losses, outputs, labels, label_cols))
    return (f"{head}: {error}. {pairs}. Labels are reshaped to the output's shape when they "
            "hold as many values (label_shapes sets it), and integer labels become float "
            f"for a float output of the same shape; {SKIP_HINT}")


def torch_metrics(groups: list, outputs: tuple, labels: list, sample: Sample,
                  label_cols: list[str]) -> None:
    """Every metric function on the sample, or a ConfigError naming the one that fails."""
    import torch

    from hvd_spark.estimator.history import metric_name

    for fns in groups:
        fns = fns * len(outputs) if len(fns) == 1 else fns
        for fn, out, label, col in zip(fns, outputs, labels, label_cols):
            try:
                with torch.no_grad():
                    float(fn(out, label))
            except Exception as exc:  # noqa: BLE001 - the user's metric: say which one
                raise ConfigError(
                    f"metric {metric_name(fn)!r} failed on {sample.rows} sample rows for "
                    f"label column {describe(sample, col)} (dry run): "
                    f"{type(exc).__name__}: {exc}. It gets (output, label): output "
                    f"{_dtype_name(out)} {tuple(out.shape)}, label {_dtype_name(label)} "
                    f"{tuple(label.shape)}, and must return one number; {SKIP_HINT}") from exc


def check_input_shapes(shapes: list | None, feature_cols: list[str], batch: dict) -> None:
    """``input_shapes`` against the sample's columns, with the message the written
    dataset's check gives (``TorchEstimator._check_dataset``)."""
    for col, shape in zip(feature_cols, shapes or []):
        if col in batch:
            batch_shape(shape, f"input_shapes (column {col!r})", values_per_row(batch[col]))


def torch_check(estimator: Any, sample: Sample, batch: dict, shapes: list | None,
                label_shapes: list | None) -> None:
    """TorchEstimator's dry run: forward, loss and metrics as the training loop has them.

    ``shapes`` and ``label_shapes`` are the Estimator's checked ``input_shapes`` and
    ``label_shapes`` (batch shapes).
    """
    import torch

    from hvd_spark.estimator import torch_worker as tw

    features, label_cols = estimator.value("feature_cols"), estimator.value("label_cols")
    check_input_shapes(shapes, features, batch)
    model = torch_model_copy(estimator.value("model"))
    inputs = tw.batch_inputs(batch, features, shapes, torch)
    outputs = torch_forward(model, inputs, sample, batch, features)
    if estimator.value("train_minibatch_fn") is not None:
        return  # the user's step computes the loss its own way
    labels = [tw.to_tensor(batch[c], torch) for c in label_cols]
    labels = [t.float() if t.is_floating_point() else t for t in labels]
    weight = estimator.value("sample_weight_col")
    row_weights = tw.to_tensor(batch[weight], torch).float() if weight else None
    losses = tw.make_losses({"loss": estimator.value("loss"),
                             "loss_constructors": estimator.value("loss_constructors")})
    weights = estimator.value("loss_weights") or [1.0 / len(label_cols)] * len(label_cols)
    transform_outputs = tw.make_transform_outputs(label_shapes)
    try:
        outs, labels = transform_outputs(outputs, labels)
    except Exception as exc:  # noqa: BLE001 - label_shapes that do not fit the labels
        raise ConfigError(
            f"the labels do not fit label_shapes on {sample.rows} sample rows (dry run): "
            f"{type(exc).__name__}: {exc}; labels: {received(sample, batch, label_cols)}") \
            from exc
    torch_loss(tw.make_loss_fn(losses, weights), losses, outs, labels, row_weights, sample,
               batch, label_cols)
    torch_metrics(tw.metric_groups(estimator.value("metrics")), outs, labels, sample,
                  label_cols)


def lightning_check(estimator: Any, sample: Sample, batch: dict, shapes: list | None) -> None:
    """LightningEstimator's dry run: the forward pass only (``training_step`` may need a
    Trainer; the ranks call the forward pass on the features for the output shapes).

    ``shapes`` are the Estimator's checked ``input_shapes`` (batch shapes).
    """
    import torch

    from hvd_spark.estimator import torch_worker as tw

    features = estimator.value("feature_cols")
    check_input_shapes(shapes, features, batch)
    model = torch_model_copy(estimator.value("model"))
    torch_forward(model, tw.batch_inputs(batch, features, shapes, torch), sample, batch, features)
