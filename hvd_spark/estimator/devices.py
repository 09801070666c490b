"""The Estimators' GPUs: which device a rank trains on, and telling the user when none did.

Rank side (no pyspark, no framework): :func:`own_gpu_index` picks the rank's own device
among those it sees; the device-choice functions of the workers (``training_device``,
``place_keras``) call :func:`note_gpu_seen`, and :func:`run_reporting` hands that back to
the driver with the worker's result. Driver side: :func:`unwrap` splits the results from
those reports, and :func:`warn_if_no_gpu` warns once when the user asked for GPUs by
name and no rank saw one.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from hvd_spark.task import device_index

# Set by the worker's device choice in this rank's process (one fit per process).
_seen: bool | None = None


def own_gpu_index(local_rank: int, count: int) -> int:
    """The index, among the ``count`` CUDA devices the rank sees, of its own GPU.

    ``HVD_SPARK_GPU_INDEX`` (the Spark launchers know the rank's GPU, also when ranks
    share one); elsewhere (``hvdrun``, a custom backend) Horovod's ``local_rank``,
    wrapped around the devices there are.

    Args:
        local_rank: The rank's local rank.
        count: The devices the rank sees (at least 1).
    """
    index = device_index()
    if index is not None and index < count:
        return index
    return local_rank % count


def note_gpu_seen(seen: bool) -> None:
    """Record whether this rank saw a GPU when ``use_gpu`` asked for one."""
    global _seen
    _seen = seen


@dataclasses.dataclass(frozen=True)
class RankReport:
    """A worker's result and whether its rank saw a GPU.

    Attributes:
        result: What the worker returned.
        gpu_seen: True/False when the worker looked for a GPU, None when it did not
            (``use_gpu=False``, or a worker that chooses no device).
    """

    result: Any
    gpu_seen: bool | None


def run_reporting(worker: Callable[[Any, Any], Any], spec: Any, payload: Any) -> RankReport:
    """Run the Estimator's worker on a rank; its result with whether it saw a GPU."""
    global _seen
    _seen = None
    result = worker(spec, payload)
    return RankReport(result, _seen)


def unwrap(results: Sequence[Any]) -> tuple[list[Any], list[bool | None]]:
    """The workers' results and GPU reports (None for a result that carries none)."""
    reports = [r if isinstance(r, RankReport) else RankReport(r, None) for r in results]
    return [r.result for r in reports], [r.gpu_seen for r in reports]


def no_gpu_message(estimator: str, ranks: int) -> str:
    """What the driver says when ``use_gpu=True`` was asked for and no rank saw a GPU."""
    return (
        f"{estimator}(use_gpu=True): none of the {ranks} ranks saw a GPU, so training ran "
        "on the CPU. To train on GPUs, run on executors with GPUs and a CUDA build of the "
        "framework, with the Spark session scheduling them (spark.executor.resource.gpu."
        "amount, spark.executor.resource.gpu.discoveryScript, spark.task.resource.gpu."
        "amount); or pass use_gpu=False to train on the CPU without this warning.")


def warn_if_no_gpu(estimator: str, asked: bool, seen: Sequence[bool | None]) -> bool:
    """Warn (``warnings.warn``: shown in a notebook as is) when GPUs were asked for by
    name and every rank looked and saw none.

    Args:
        estimator: The Estimator's class name, for the message.
        asked: The user set ``use_gpu=True`` explicitly (Horovod's default stays quiet).
        seen: Each rank's report (``RankReport.gpu_seen``).

    Returns:
        Whether it warned.
    """
    if not asked or not seen or any(s is not False for s in seen):
        return False
    warnings.warn(no_gpu_message(estimator, len(seen)), UserWarning, stacklevel=2)
    return True
