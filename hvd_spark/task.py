"""Inside a rank: what its Spark task was given (Horovod's ``horovod.spark.task``).

A rank of ``hvd_spark.run`` runs in a child process of its Spark task, where
``TaskContext.get()`` is None; the task passes what the rank needs from its context in
the environment instead. This module reads it and imports no Spark, so it works in any
rank (``hvdrun``, ``hvd_spark.run_local``, a plain ``python``) as well.
"""

from __future__ import annotations

import os

from hvd_spark import _env

__all__ = ["device_index", "get_available_devices"]


def _addresses(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _cuda_visible(value: str) -> list[str]:
    # CUDA ignores an invalid index and all after it; "-1" is the usual way to hide every GPU.
    visible: list[str] = []
    for entry in _addresses(value):
        if entry.startswith("-"):
            break
        visible.append(entry)
    return visible


def get_available_devices() -> list[str]:
    """The GPU addresses assigned to this rank, as Horovod's ``get_available_devices()``.

    Under ``hvd_spark.run`` these are the addresses Spark's GPU scheduling gave the rank's
    task (``TaskContext.resources()["gpu"].addresses``): the machine's numbering, e.g.
    ``["2"]``. ``hvd_spark.run(use_gpu=True)`` (the default when Spark schedules GPUs) shows
    the ranks of a host that host's GPUs of the job as ``CUDA_VISIBLE_DEVICES``, the rank's
    own first at device ``local_rank`` (or :func:`device_index` where ranks share a GPU);
    ``use_gpu=False`` leaves the executor's ``CUDA_VISIBLE_DEVICES`` alone as Horovod does,
    where an address is a device index.

    Returns:
        Under a Spark task: its GPU addresses (``[]`` when Spark scheduled none). Elsewhere
        (``hvdrun``, no launcher): the entries of ``CUDA_VISIBLE_DEVICES`` before any
        negative one (``-1`` hides all GPUs), else ``[]``.
    """
    value = os.environ.get(_env.TASK_GPUS)
    if value is not None:
        return _addresses(value)
    return _cuda_visible(os.environ.get("CUDA_VISIBLE_DEVICES", ""))


def device_index() -> int | None:
    """The CUDA device index of this rank's own GPU, for ``torch.cuda.set_device``.

    ``hvd.local_rank()`` is that index under ``hvd_spark.run(use_gpu=True)`` when every
    rank of a host has a GPU of its own; this is it in every case, also where ranks share
    a GPU (``spark.task.resource.gpu.amount`` < 1: both see it once, at one index) and
    under ``run_elastic`` (the rank keeps the executor's devices and its local rank
    changes as the ring re-forms). Where the rank holds several GPUs, this is its first.

    Returns:
        ``HVD_SPARK_GPU_INDEX`` as set by the Spark launchers for a rank whose task has a
        GPU; None elsewhere (no GPU, ``use_gpu=False``, ``hvdrun``: use ``local_rank``).
    """
    value = os.environ.get(_env.GPU_INDEX, "").strip()
    return int(value) if value.isdigit() else None
