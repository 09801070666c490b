"""Per-epoch metrics: accumulate on a rank, average over ranks, report on the driver."""

from __future__ import annotations

import sys
from typing import Any


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
    """Write one line per epoch on rank 0's stdout.

    This is the progress channel: hvd_spark.run forwards the line live to the driver
    (and so to a notebook cell), prefixed with the rank.
    """
    if verbose < 1:
        return
    metrics = ", ".join(f"{k}={v:.4f}" for k, v in record.items() if k != "epoch")
    sys.stdout.write(f"epoch {record['epoch']}/{epochs}: {metrics}\n")
    sys.stdout.flush()
