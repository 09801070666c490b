"""Inside a rank: what its Spark task was given (Horovod's ``horovod.spark.task``).

A rank of ``hvd_spark.run`` runs in a child process of its Spark task, where
``TaskContext.get()`` is None; the task passes what the rank needs from its context in
the environment instead. This module reads it and imports no Spark, so it works in any
rank (``hvdrun``, ``hvd_spark.run_local``, a plain ``python``) as well.
"""

from __future__ import annotations

import os

from hvd_spark import _env

__all__ = ["get_available_devices"]


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
    ``["2"]``. ``hvd_spark.run(use_gpu=True)`` (the default when Spark schedules GPUs) also
    limits the rank's ``CUDA_VISIBLE_DEVICES`` to them, so inside the rank they are CUDA
    devices ``0 .. n-1``: pin ``0``, or pass ``use_gpu=False`` to leave the executor's
    ``CUDA_VISIBLE_DEVICES`` alone as Horovod does, where an address is a device index.

    Returns:
        Under a Spark task: its GPU addresses (``[]`` when Spark scheduled none). Elsewhere
        (``hvdrun``, no launcher): the entries of ``CUDA_VISIBLE_DEVICES`` before any
        negative one (``-1`` hides all GPUs), else ``[]``.
    """
    value = os.environ.get(_env.TASK_GPUS)
    if value is not None:
        return _addresses(value)
    return _cuda_visible(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
