"""Per-epoch metrics: accumulate on a rank, average over ranks, report to the driver."""

from __future__ import annotations

import sys
from typing import Any

from hvd_spark.runner import progress_events


def accumulate(sums: dict[str, float], name: str, value: float) -> None:
    """Add ``value`` to the running sum ``name``."""
    sums[name] = sums.get(name, 0.0) + value


def metric_name(fn: Any) -> str:
    """A metric's display name: its ``name`` attribute, else its function/class name."""
    return getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__


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
