"""Per-epoch metrics: accumulate on a rank, average over ranks, report to the driver."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from hvd_spark.runner import progress_events


def accumulate(sums: dict[str, float], name: str, value: float) -> None:
    """Add ``value`` to the running sum ``name``."""
    sums[name] = sums.get(name, 0.0) + value


def metric_name(fn: Any) -> str:
    """A metric's display name: its ``name`` attribute, else its function/class name."""
    return getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__


def plain_metric_names(groups: list[list[Any]], label_cols: Sequence[str]) -> dict[str, str]:
    """Keras-style names of the TorchEstimator's metrics, by Horovod's key.

    Horovod's torch history names a metric ``group_<i>_<label column>`` (``getHistory()``
    keeps that shape). Keras users look for the metric's own name: ``accuracy`` for one
    label column, ``<label column>_accuracy`` for several (Keras names a multi-output
    model's metrics so). A function without a usable name (a lambda) is ``metric_<i>``; a
    name already taken (the same function twice, or ``loss``) gets ``_<i>``.

    Args:
        groups: Horovod's metric groups (``torch_worker.metric_groups``).
        label_cols: The label columns, one per model output.

    Returns:
        ``{"group_0_label": "accuracy", ...}``; validation keys add ``val_`` to both.
    """
    names: dict[str, str] = {}
    taken = {"loss"}
    for g, fns in enumerate(groups):
        fns = fns * len(label_cols) if len(fns) == 1 else fns
        for fn, col in zip(fns, label_cols):
            base = metric_name(fn)
            base = base if base.isidentifier() else f"metric_{g}"
            plain = base if len(label_cols) == 1 else f"{col}_{base}"
            if plain in taken or plain.startswith("val_"):
                plain = f"{plain}_{g}"
            taken.add(plain)
            names[f"group_{g}_{col}"] = plain
    return names


def with_plain_names(record: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``record`` plus the plain name of each Horovod metric key in it (and ``val_`` ones)."""
    out = dict(record)
    for key, plain in names.items():
        for prefix in ("", "val_"):
            if prefix + key in record:
                out[prefix + plain] = record[prefix + key]
    return out


def displayed(record: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``record`` without the Horovod keys that have a plain name: what the console, the
    TensorBoard file and MLflow get."""
    hidden = {prefix + key for key in names for prefix in ("", "val_")}
    return {k: v for k, v in record.items() if k not in hidden}


def prefixed(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    """``{"loss": x}`` -> ``{"val_loss": x}``."""
    return {prefix + k: v for k, v in metrics.items()}


def average_over_ranks(record: dict[str, Any]) -> dict[str, Any]:
    """Average every numeric metric (not ``epoch``) over the ranks with one allreduce."""
    import numpy as np

    import hvd_spark.collectives as collectives

    keys = sorted(k for k, v in record.items() if k != "epoch" and isinstance(v, float))
    if not keys:
        return record
    values = np.array([record[k] for k in keys], np.float64)
    averaged = collectives.allreduce(values, name=f"estimator.metrics.{record['epoch']}")
    return {**record, **{k: float(v) for k, v in zip(keys, averaged)}}


def report(record: dict[str, Any], epochs: int, verbose: int) -> None:
    """Rank 0's end of an epoch: an ``epoch`` progress event to the driver, which keeps it
    as one line under its progress bar (with ``verbose >= 1``) and in TensorBoard; without
    a driver that takes events (``hvdrun``), one ``epoch e/epochs: metrics`` line on
    stdout instead."""
    metrics = {k: v for k, v in record.items() if k != "epoch"}
    # Sent whatever ``verbose`` says: the driver also writes it for TensorBoard.
    if progress_events.send(0, {"kind": "epoch", "epoch": record["epoch"], "epochs": epochs,
                                "metrics": metrics}) or verbose < 1:
        return
    text = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if isinstance(v, float))
    sys.stdout.write(f"epoch {record['epoch']}/{epochs}: {text}\n")
    sys.stdout.flush()


def step(verbose: int, epoch: int, step_done: int, steps: int | None, loss: float,
         samples: int, elapsed: float) -> None:
    """Rank 0 after a training step: a (rate-limited) ``step`` event for the driver's bar
    and TensorBoard.

    Args:
        verbose: The fit's verbosity (the driver decides what to draw).
        epoch: The epoch, counted from 1.
        step_done: Steps finished in this epoch.
        steps: Steps per epoch, when known.
        loss: The epoch's running mean loss on rank 0.
        samples: Rows trained on in this epoch, over all ranks.
        elapsed: Seconds since the epoch started.
    """
    del verbose  # kept in the signature: the workers pass it, the driver decides
    progress_events.send(0, {"kind": "step", "epoch": epoch, "step": step_done,
                             "steps": steps, "loss": loss, "samples": samples,
                             "elapsed": elapsed})
