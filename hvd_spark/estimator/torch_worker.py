"""The TorchEstimator's worker side: the training loop every rank runs, and the predictor.

No pyspark here: this runs in the ranks' processes (and under ``hvdrun``). With
``use_gpu`` (the default) each rank trains on one CUDA device when torch sees one:
the one its Spark task was given (``HVD_SPARK_GPU_INDEX``), else
``local_rank % device_count``; otherwise on the CPU. Gradients
are still reduced on the CPU by the TCP ring (the engine stages CUDA tensors through
host memory); the saved model is moved to the CPU, so ``transform`` needs no GPU.

The loop follows Horovod's: losses weighted by ``loss_weights`` (default
``1/len(label_cols)`` each), labels reshaped to ``label_shapes`` or to the output's
shape when they hold as many values, per-row weights multiplied into the per-row
losses before the mean, the loss divided by ``backward_passes_per_step`` when
accumulating, and metrics in groups named ``group_<i>_<label column>``.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np

from hvd_spark.estimator import history as hist
from hvd_spark.estimator import torch_amp
from hvd_spark.estimator.learning_rate import PARAM as SCALE_PARAM
from hvd_spark.estimator.learning_rate import TorchRates
from hvd_spark.estimator.step_checkpoints import (
    ResumePoint,
    read_step_checkpoint,
    save_step_checkpoint,
)
from hvd_spark.estimator.train_spec import (
    TrainSpec,
    check_loss,
    make_readers,
    set_start_method,
)

log = logging.getLogger("hvd_spark.estimator")


def training_device(use_gpu: bool, local_rank: int, torch: Any) -> Any:
    """This rank's device: its own GPU when ``use_gpu`` and torch sees one, else the CPU.

    Its own: the one Spark assigned it (``HVD_SPARK_GPU_INDEX``, also where ranks share a
    GPU), else ``local_rank`` wrapped around the devices (``devices.own_gpu_index``).
    Records for the driver whether a GPU was seen (it warns when none was).
    """
    from hvd_spark.estimator import devices

    seen = use_gpu and torch.cuda.is_available()
    if use_gpu:
        devices.note_gpu_seen(seen)
    if not seen:
        if use_gpu and local_rank == 0:
            log.info("use_gpu=True but torch sees no CUDA device (torch %s, CUDA_VISIBLE_DEVICES"
                     "=%r): training on the CPU", torch.__version__,
                     os.environ.get("CUDA_VISIBLE_DEVICES"))
        return torch.device("cpu")
    index = devices.own_gpu_index(local_rank, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def make_losses(payload: dict) -> list:
    """The loss functions, one per output: built from ``loss_constructors`` or the ``loss``."""
    if payload["loss_constructors"]:
        return [make() for make in payload["loss_constructors"]]
    loss = payload["loss"]
    return list(loss) if isinstance(loss, (list, tuple)) else [loss]


def metric_groups(metrics: Any) -> list[list[Callable]]:
    """Horovod's metric groups: each entry is one function (for every output) or a list
    of one function per output; a single function is one group."""
    if metrics is None:
        return []
    if callable(metrics):
        return [[metrics]]
    return [list(m) if isinstance(m, (list, tuple)) else [m] for m in metrics]


def to_tensor(values: np.ndarray, torch: Any, device: Any = None) -> Any:
    """One column of a batch as a tensor on ``device`` (the CPU when ``None``)."""
    # Shuffled batches are the reader's own (writable) arrays: shared, not copied. Unshuffled
    # ones may be read-only views of Arrow buffers, which torch cannot share: copied.
    # Pinned memory lets the copy to a GPU run asynchronously.
    writable = values.flags.writeable and values.flags.c_contiguous
    t = torch.from_numpy(values if writable else np.array(values))
    if device is None or device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def batch_inputs(batch: dict, cols, shapes, torch, device: Any = None) -> list:
    """The model's inputs from a batch: the ``cols`` as float tensors, reshaped to ``shapes``."""
    out = []
    for i, col in enumerate(cols):
        t = to_tensor(batch[col], torch, device)
        if t.is_floating_point():
            t = t.float()
        if shapes:
            t = t.reshape(shapes[i])  # batch shapes: (-1, *row shape)
        out.append(t)
    return out


def as_tuple(outputs) -> tuple:
    """A model's outputs as a tuple (one output becomes a tuple of one)."""
    return tuple(outputs) if isinstance(outputs, (list, tuple)) else (outputs,)


def make_transform_outputs(label_shapes: list | None) -> Callable:
    """Horovod's ``transform_outputs(outputs, labels) -> (outputs, labels)``."""

    def transform_outputs(outputs, labels):
        outputs = list(as_tuple(outputs))
        if label_shapes:
            labels = [label.reshape(shape) for label, shape in zip(labels, label_shapes)]
        else:
            labels = [label.reshape(out.shape) if out.numel() == label.numel() else label
                      for label, out in zip(labels, outputs)]
        labels = [label.float() if (out.is_floating_point() and not label.is_floating_point()
                                    and out.shape == label.shape) else label
                  for label, out in zip(labels, outputs)]
        return outputs, labels

    return transform_outputs


def make_loss_fn(losses: list, loss_weights: list[float]) -> Callable:
    """``loss_fn(outputs, labels, sample_weights) -> loss`` as Horovod computes it."""

    def per_row(fn, out, label):
        import torch

        if isinstance(fn, torch.nn.Module):
            return fn(out, label)  # must have been built with reduction="none"
        return fn(out, label, reduction="none")

    def loss_fn(outputs, labels, sample_weights=None):
        total = 0.0
        for out, label, fn, weight in zip(outputs, labels, losses, loss_weights):
            if sample_weights is None:
                value = fn(out, label)
            else:
                value = (per_row(fn, out, label).reshape(-1) * sample_weights).mean()
            total = total + value * weight
        return total

    return loss_fn


def default_minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels,
                      sample_weights, backward_passes_per_step, batch_idx):
    """One training step; Horovod's ``train_minibatch`` signature, stepping the optimizer
    every ``backward_passes_per_step`` batches."""
    outputs, labels = transform_outputs(model(*inputs), labels)
    loss = loss_fn(outputs, labels, sample_weights)
    scaled = loss / backward_passes_per_step if backward_passes_per_step > 1 else loss
    scaled.backward()
    if (batch_idx + 1) % backward_passes_per_step == 0:
        optimizer.step()
        optimizer.zero_grad()
    return outputs, loss


def _move_optimizer_state(optimizer) -> None:
    # load_state_dict casts the state (momentum, ...) to each parameter's device.
    optimizer.load_state_dict(optimizer.state_dict())


def optimizer_record(model, optimizer, state: dict, torch) -> bytes:
    """The optimizer as bytes that ``TorchModel.getOptimizer`` maps onto a model copy;
    ``state`` is its state dict as saved (with the user's learning rates)."""
    names = {id(p): n for n, p in model.named_parameters()}
    buf = io.BytesIO()
    torch.save({"cls": type(optimizer), "defaults": dict(optimizer.defaults),
                "state": state,
                "group_names": [[names[id(p)] for p in g["params"]]
                                for g in optimizer.param_groups]}, buf)
    return buf.getvalue()


def train_torch(spec: TrainSpec, payload: dict) -> dict | None:
    """Runs on every rank: the training loop of TorchEstimator."""
    set_start_method(spec.mp_start_method)
    import torch

    import hvd_spark.torch as hvd

    hvd.init()
    if spec.framework_seed is not None:
        torch.manual_seed(spec.framework_seed)
    ds = spec.dataset
    device = training_device(spec.use_gpu, hvd.local_rank(), torch)
    # Unpickled together, the optimizer's param groups refer to this copy's parameters.
    model, optimizer = cloudpickle.loads(payload["model_and_optimizer"])
    model.to(device)
    losses = make_losses(payload)
    weights = payload["loss_weights"] or [1.0 / len(ds.label_cols)] * len(ds.label_cols)
    loss_fn = make_loss_fn(losses, weights)
    groups = metric_groups(payload["metrics"])
    plain = hist.plain_metric_names(groups, ds.label_cols)  # Keras users' names too
    transform_outputs = make_transform_outputs(spec.label_shapes)
    minibatch = payload["train_minibatch_fn"]() if payload["train_minibatch_fn"] else None
    mode = spec.extra.get(torch_amp.PARAM)
    amp = torch_amp.AmpStep(mode, device, torch) if mode else None
    shapes = payload["input_shapes"]
    history: list[dict] = []
    resumed: dict = {"sums": {}, "steps": 0}  # this rank's part of a step checkpoint
    if spec.start_step > 0:
        point = ResumePoint(spec.start_epoch, spec.start_step)
        state = torch.load(io.BytesIO(read_step_checkpoint(spec.store, spec.run_id, point)),
                           map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        history = state["history"]
        if amp:
            amp.load_state_dict(state.get("scaler"))
        ranks = state["ranks"]
        resumed = {**ranks[hvd.rank() % len(ranks)], "steps": spec.start_step}
        if len(ranks) == hvd.size():  # same ranks: same dropout masks as without the loss
            torch.set_rng_state(resumed["rng"])
    elif spec.start_epoch > 0:
        found = spec.store.latest_checkpoint(spec.run_id)
        if found is not None:
            state = torch.load(io.BytesIO(found[1]), map_location=device, weights_only=False)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            history = state["history"]
            if amp:
                amp.load_state_dict(state.get("scaler"))
            ranks = state.get("ranks") or []  # absent in checkpoints of older versions
            if len(ranks) == hvd.size():  # same ranks: the same dropout masks go on
                torch.set_rng_state(ranks[hvd.rank()]["rng"])
    _move_optimizer_state(optimizer)
    # Horovod's rule: ranks train at size x the user's rate; what is saved carries the user's.
    rates = TorchRates(optimizer, hvd.size() if spec.extra.get(SCALE_PARAM) else 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    dist_opt = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=spec.compression or hvd.Compression.none,
        backward_passes_per_step=spec.backward_passes_per_step)
    reader, val_reader = make_readers(spec, hvd.rank(), hvd.size())

    def prepare(batch):
        inputs = batch_inputs(batch, ds.feature_cols, shapes, torch, device)
        labels = [to_tensor(batch[c], torch, device) for c in ds.label_cols]
        labels = [t.float() if t.is_floating_point() else t for t in labels]
        row_weights = (to_tensor(batch[ds.sample_weight_col], torch, device).float()
                       if ds.sample_weight_col else None)
        return inputs, labels, row_weights

    def add_metrics(sums, outputs, labels):
        for g, fns in enumerate(groups):
            fns = fns * len(outputs) if len(fns) == 1 else fns
            for fn, out, label, col in zip(fns, outputs, labels, ds.label_cols):
                hist.accumulate(sums, f"group_{g}_{col}", float(fn(out, label)))

    def scaler_state() -> dict | None:
        # Every rank unscales the same averaged gradients: rank 0's scale is every rank's.
        return amp.state_dict() if amp else None

    def step_checkpoint(epoch: int, steps_done: int, sums: dict) -> None:
        """Every ``checkpoint_every_steps`` (after an optimizer step): the model, the
        optimizer and each rank's running sums and generator state, written by rank 0."""
        every = spec.checkpoint_every_steps if spec.store is not None else None
        if (not every or steps_done % every or steps_done % spec.backward_passes_per_step
                or steps_done >= reader.steps_per_epoch):
            return
        ranks = hvd.allgather_object({"sums": dict(sums), "rng": torch.get_rng_state()},
                                     name=f"hvd_spark.step_checkpoint.{epoch}.{steps_done}")
        if hvd.rank() == 0:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": rates.unscaled_state(),
                        "history": history, "ranks": ranks, "scaler": scaler_state()}, buf)
            save_step_checkpoint(spec.store, spec.run_id, epoch, steps_done, buf.getvalue())

    def train_epoch(epoch) -> dict:
        first = epoch == spec.start_epoch
        sums: dict[str, float] = dict(resumed["sums"]) if first else {}
        model.train()
        steps, rows, started = 0, 0, time.monotonic()
        skip = resumed["steps"] if first else 0
        steps += skip  # trained before the step checkpoint: they count in the epoch's mean
        for step, batch in enumerate(reader.epoch(epoch)):
            if step < skip:
                continue  # the same batches in the same order as before the loss
            inputs, labels, row_weights = prepare(batch)
            run = minibatch or (amp.minibatch if amp else default_minibatch)
            outputs, loss = run(model, dist_opt, transform_outputs, loss_fn, inputs, labels,
                                row_weights, spec.backward_passes_per_step, step)
            outputs, labels = transform_outputs(outputs, labels)
            value = float(loss.detach())
            check_loss(value, epoch, step, spec, reader.steps_per_epoch, hvd.rank())
            hist.accumulate(sums, "loss", value)
            with torch.no_grad():
                add_metrics(sums, outputs, labels)
            steps += 1
            step_checkpoint(epoch, step + 1, sums)
            rows += len(labels[0]) * hvd.size()  # every rank trains on equal batches
            if hvd.rank() == 0:
                hist.step(spec.verbose, epoch + 1, steps, reader.steps_per_epoch,
                          sums["loss"] / steps, rows, time.monotonic() - started)
        if minibatch is None and steps % spec.backward_passes_per_step:
            # The epoch ended inside an accumulation: step on what was accumulated, as
            # Lightning does (the batch index restarts each epoch, so carrying the passes
            # over would exceed backward_passes_per_step before the next step).
            if amp:
                amp.step(dist_opt)
            else:
                dist_opt.step()
            dist_opt.zero_grad()
        return {k: v / max(steps, 1) for k, v in sums.items()}

    def val_epoch(epoch) -> dict:
        sums: dict[str, float] = {}
        model.eval()
        steps = 0
        with torch.no_grad():
            for batch in val_reader.epoch(epoch):
                inputs, labels, row_weights = prepare(batch)
                outputs, labels = transform_outputs(model(*inputs), labels)
                hist.accumulate(sums, "loss", float(loss_fn(outputs, labels, row_weights)))
                add_metrics(sums, outputs, labels)
                steps += 1
        return {k: v / max(steps, 1) for k, v in sums.items()}

    for epoch in range(spec.start_epoch, spec.epochs):
        record = {"epoch": epoch + 1, **train_epoch(epoch)}
        if val_reader is not None:
            record.update(hist.prefixed("val_", val_epoch(epoch)))
        record = hist.with_plain_names(hist.average_over_ranks(record), plain)
        history.append(record)
        # Each rank's generator too: a fit resumed here draws what it would have drawn.
        ranks = (hvd.allgather_object({"rng": torch.get_rng_state()},
                                      name=f"hvd_spark.epoch_checkpoint.{epoch}")
                 if spec.store is not None else None)
        if hvd.rank() == 0:
            hist.report(hist.displayed(record, plain), spec.epochs, spec.verbose)
        if hvd.rank() == 0 and spec.store is not None:  # the direct path keeps no checkpoints
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": rates.unscaled_state(),
                        "history": history, "scaler": scaler_state(), "ranks": ranks}, buf)
            spec.store.save_checkpoint(spec.run_id, epoch, buf.getvalue())
    if hvd.rank() != 0:
        return None
    model.eval().cpu()  # saved and used by transform on the CPU
    _move_optimizer_state(optimizer)
    sample = next(iter(reader.epoch(0)))
    with torch.no_grad():
        outs = as_tuple(model(*batch_inputs(sample, ds.feature_cols, shapes, torch)))
    return {
        "model": cloudpickle.dumps({"model": model, "input_shapes": shapes}),
        "optimizer": optimizer_record(model, optimizer, rates.unscaled_state(), torch),
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
            inputs = batch_inputs(dict(enumerate(arrays)), range(len(arrays)), shapes, torch)
            return [o.numpy() for o in as_tuple(model(*inputs))]

    return predict
