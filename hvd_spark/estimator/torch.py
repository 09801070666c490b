"""TorchEstimator / TorchModel: fit a torch.nn.Module on a DataFrame with hvd_spark.

torch is imported only inside the worker and predictor functions, so the driver
can build the estimator (and this module imports) without it.
"""

from __future__ import annotations

import io
from typing import Any

import cloudpickle
import numpy as np

from hvd_spark.errors import ConfigError
from hvd_spark.estimator import history as hist
from hvd_spark.estimator.base import HvdEstimator, HvdModel, TrainSpec, define, make_readers

TORCH_PARAMS = [
    ("inputShapes", "shape of each feature input per row, e.g. [[1, 8, 8]]", None, None),
    ("lossConstructors", "callables returning the loss function(s)", None, None),
]


class TorchModel(HvdModel):
    """A TorchEstimator's trained model; ``transform`` adds ``<label>__output`` columns."""

    def _predictor_factory(self):
        return torch_predictor

    def getModel(self):  # noqa: N802 - Spark ML naming
        """The trained torch module (on CPU, in eval mode)."""
        return cloudpickle.loads(self.model_bytes)["model"]


class TorchEstimator(HvdEstimator):
    """Spark ML Estimator training a torch model with hvd_spark's DistributedOptimizer.

    Keywords are Horovod's: ``num_proc, model, optimizer, loss, loss_constructors,
    metrics, feature_cols, label_cols, input_shapes, batch_size, val_batch_size, epochs,
    validation, store, run_id, shuffle, random_seed, verbose, sample_weight_col,
    train_steps_per_epoch, validation_steps_per_epoch, partitions_per_process,
    gradient_compression, backward_passes_per_step, use_gpu`` and ``output_cols``.

    The optimizer is re-created on every rank from its class and ``defaults`` bound to
    that rank's copy of the model; its learning rate is used as given (not scaled by
    the number of ranks: scale it yourself if you want the Horovod convention).
    With ``sample_weight_col``, the loss must return per-row values
    (``reduction="none"``); they are weighted and averaged.
    """

    def _model_class(self):
        return TorchModel

    def _check_framework(self) -> None:
        import torch

        model, optimizer = self.value("model"), self.value("optimizer")
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if self.value("loss") is None and self.value("lossConstructors") is None:
            raise ConfigError("TorchEstimator needs loss=... or loss_constructors=[...]")

    def _payload(self) -> dict:
        optimizer = self.value("optimizer")
        return {
            "model": cloudpickle.dumps(self.value("model")),
            "optimizer_cls": type(optimizer),
            "optimizer_defaults": dict(optimizer.defaults),
            "loss": self.value("loss"),
            "loss_constructors": self.value("lossConstructors"),
            "metrics": self.value("metrics") or [],
            "input_shapes": self.value("inputShapes"),
        }

    def _worker(self):
        return train_torch


define(TorchEstimator, TORCH_PARAMS)


def _losses(payload: dict) -> list:
    if payload["loss_constructors"]:
        return [make() for make in payload["loss_constructors"]]
    loss = payload["loss"]
    return list(loss) if isinstance(loss, (list, tuple)) else [loss]


def _inputs(batch: dict, cols, shapes, torch) -> list:
    out = []
    for i, col in enumerate(cols):
        t = torch.as_tensor(np.array(batch[col]))  # a writable copy: Arrow buffers are read-only
        if t.is_floating_point():
            t = t.float()
        if shapes:
            t = t.reshape(-1, *shapes[i])
        out.append(t)
    return out


def _as_tuple(outputs) -> tuple:
    return tuple(outputs) if isinstance(outputs, (list, tuple)) else (outputs,)


def _batch_loss(outputs, labels, losses, weights, torch):
    total = 0.0
    for out, label, fn in zip(outputs, labels, losses):
        if not label.is_floating_point() and out.is_floating_point() and out.dim() == label.dim():
            label = label.float()
        if label.dim() == 1 and out.dim() == 2 and out.shape[1] == 1 and label.is_floating_point():
            label = label.reshape(-1, 1)
        value = fn(out, label)
        if weights is not None:
            value = (value.reshape(-1) * weights).sum() / weights.sum()
        total = total + value
    return total


def train_torch(spec: TrainSpec, payload: dict) -> dict | None:
    """Runs on every rank: the training loop of TorchEstimator."""
    import torch

    import hvd_spark.torch as hvd

    hvd.init()
    torch.manual_seed(spec.seed)
    ds = spec.dataset
    model = cloudpickle.loads(payload["model"])
    optimizer = payload["optimizer_cls"](model.parameters(), **payload["optimizer_defaults"])
    losses, metrics = _losses(payload), list(payload["metrics"])
    shapes = payload["input_shapes"]
    history: list[dict] = []
    if spec.start_epoch > 0:
        found = spec.store.latest_checkpoint(spec.run_id)
        if found is not None:
            state = torch.load(io.BytesIO(found[1]), weights_only=False)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            history = state["history"]
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    dist_opt = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=spec.compression or hvd.Compression.none,
        backward_passes_per_step=spec.backward_passes_per_step)
    reader, val_reader = make_readers(spec, hvd.rank(), hvd.size())

    def run_epoch(source, epoch, train: bool) -> dict:
        sums: dict[str, float] = {}
        steps = 0
        model.train(train)
        with torch.set_grad_enabled(train):
            for step, batch in enumerate(source.epoch(epoch)):
                inputs = _inputs(batch, ds.feature_cols, shapes, torch)
                labels = [torch.as_tensor(np.array(batch[c])) for c in ds.label_cols]
                weights = (torch.as_tensor(np.array(batch[ds.sample_weight_col])).float()
                           if ds.sample_weight_col else None)
                outputs = _as_tuple(model(*inputs))
                loss = _batch_loss(outputs, labels, losses, weights, torch)
                if train:
                    loss.backward()
                    if (step + 1) % spec.backward_passes_per_step == 0:
                        dist_opt.step()
                        dist_opt.zero_grad()
                hist.accumulate(sums, "loss", float(loss.detach()))
                for fn in metrics:
                    hist.accumulate(sums, hist.metric_name(fn), float(fn(outputs[0], labels[0])))
                steps += 1
        return {k: v / max(steps, 1) for k, v in sums.items()}

    for epoch in range(spec.start_epoch, spec.epochs):
        record = {"epoch": epoch + 1, **run_epoch(reader, epoch, True)}
        if val_reader is not None:
            record.update(hist.prefixed("val_", run_epoch(val_reader, epoch, False)))
        record = hist.average_over_ranks(record)
        history.append(record)
        if hvd.rank() == 0:
            hist.report(record, spec.epochs, spec.verbose)
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "history": history}, buf)
            spec.store.save_checkpoint(spec.run_id, epoch, buf.getvalue())
    if hvd.rank() != 0:
        return None
    model.eval()
    sample = next(iter(reader.epoch(0)))
    with torch.no_grad():
        outs = _as_tuple(model(*_inputs(sample, ds.feature_cols, shapes, torch)))
    return {
        "model": cloudpickle.dumps({"model": model.cpu(), "input_shapes": shapes}),
        "history": history,
        "output_shapes": [tuple(o.shape[1:]) for o in outs],
    }


def torch_predictor(model_bytes: bytes):
    """Model bytes -> ``predict(list of numpy inputs) -> list of numpy outputs``."""
    import torch

    saved = cloudpickle.loads(model_bytes)
    model, shapes = saved["model"].eval(), saved["input_shapes"]

    def predict(arrays: list[Any]) -> list:
        with torch.no_grad():
            inputs = _inputs(dict(enumerate(arrays)), range(len(arrays)), shapes, torch)
            return [o.numpy() for o in _as_tuple(model(*inputs))]

    return predict
