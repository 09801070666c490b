"""The TorchEstimator's worker side: the training loop every rank runs, and the predictor.

No pyspark here: this runs in the ranks' processes (and under ``hvdrun``). With
``use_gpu`` each rank trains on one CUDA device: the only one its Spark task was
given (``CUDA_VISIBLE_DEVICES``), or ``local_rank % device_count`` when it sees
several. Gradients are still reduced on the CPU by the TCP ring (the engine stages
CUDA tensors through host memory); the saved model is moved to the CPU, so
``transform`` needs no GPU.
"""

from __future__ import annotations

import io
import os
from typing import Any

import cloudpickle
import numpy as np

from hvd_spark.errors import ConfigError
from hvd_spark.estimator import history as hist
from hvd_spark.estimator.train_spec import TrainSpec, make_readers


def training_device(use_gpu: bool, local_rank: int, torch: Any) -> Any:
    """The torch device this rank trains on; ConfigError when a GPU is asked for but absent."""
    if not use_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"use_gpu=True, but torch sees no CUDA device on this rank (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda}; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}). Install a CUDA build of torch on "
            "the executors, or pass use_gpu=False"
        )
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _losses(payload: dict) -> list:
    if payload["loss_constructors"]:
        return [make() for make in payload["loss_constructors"]]
    loss = payload["loss"]
    return list(loss) if isinstance(loss, (list, tuple)) else [loss]


def _tensor(values: np.ndarray, torch: Any, device: Any = None) -> Any:
    # Shuffled batches are the reader's own (writable) arrays: shared, not copied. Unshuffled
    # ones may be read-only views of Arrow buffers, which torch cannot share: copied.
    # Pinned memory lets the copy to a GPU run asynchronously.
    writable = values.flags.writeable and values.flags.c_contiguous
    t = torch.from_numpy(values if writable else np.array(values))
    if device is None or device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _inputs(batch: dict, cols, shapes, torch, device: Any = None) -> list:
    out = []
    for i, col in enumerate(cols):
        t = _tensor(batch[col], torch, device)
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
    device = training_device(spec.use_gpu, hvd.local_rank(), torch)
    model = cloudpickle.loads(payload["model"]).to(device)
    optimizer = payload["optimizer_cls"](model.parameters(), **payload["optimizer_defaults"])
    losses, metrics = _losses(payload), list(payload["metrics"])
    shapes = payload["input_shapes"]
    history: list[dict] = []
    if spec.start_epoch > 0:
        found = spec.store.latest_checkpoint(spec.run_id)
        if found is not None:
            state = torch.load(io.BytesIO(found[1]), map_location=device, weights_only=False)
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
                inputs = _inputs(batch, ds.feature_cols, shapes, torch, device)
                labels = [_tensor(batch[c], torch, device) for c in ds.label_cols]
                weights = (_tensor(batch[ds.sample_weight_col], torch, device).float()
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
    model.eval().cpu()  # saved and used by transform on the CPU
    sample = next(iter(reader.epoch(0)))
    with torch.no_grad():
        outs = _as_tuple(model(*_inputs(sample, ds.feature_cols, shapes, torch)))
    return {
        "model": cloudpickle.dumps({"model": model, "input_shapes": shapes}),
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
