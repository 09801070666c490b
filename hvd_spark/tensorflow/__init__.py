"""Horovod's TensorFlow/Keras API on hvd_spark: change the import, keep the code.

``import hvd_spark.tensorflow as hvd`` (or ``hvd_spark.tensorflow.keras``, or
``hvd_spark.keras``: same names) gives ``init``, ``rank``, ``size``, tensor
collectives that work eagerly and inside ``tf.function``, ``DistributedGradientTape``,
``DistributedOptimizer`` for Keras 3 optimizers, ``callbacks`` and ``Compression``.
"""

from __future__ import annotations

from typing import Any

from hvd_spark import collectives as _C
from hvd_spark.collectives import (
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from hvd_spark.tensorflow import callbacks
from hvd_spark.tensorflow.compression import Compression, Compressor
from hvd_spark.tensorflow.gradient_tape import DistributedGradientTape
from hvd_spark.tensorflow.ops import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    broadcast_variables,
    grouped_allreduce,
    reducescatter,
)
from hvd_spark.tensorflow.optimizer import DistributedOptimizer


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str | None = None) -> Any:
    """Return root's picklable ``obj`` on every rank."""
    return _C.broadcast_object(obj, root_rank, name)


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Return every rank's picklable ``obj``, in rank order."""
    return _C.allgather_object(obj, name)


def barrier(name: str | None = None) -> None:
    """Return once every rank has called ``barrier``."""
    _C.barrier(name)


def join() -> int:
    """Wait until every rank has called ``join``; returns -1.

    Unlike Horovod, ranks that joined do not stand in for the others' later
    collectives: give every rank the same number of batches (the data reader does).
    """
    _C.barrier("hvd_spark.join")
    return -1


__all__ = [
    "Average", "Compression", "Compressor", "DistributedGradientTape", "DistributedOptimizer",
    "Max", "Min", "Product", "ReduceOp", "Sum", "allgather", "allgather_object", "allreduce",
    "alltoall", "barrier", "broadcast", "broadcast_object", "broadcast_variables", "callbacks",
    "cross_rank", "cross_size", "grouped_allreduce", "init", "is_initialized", "join",
    "local_rank", "local_size", "rank", "reducescatter", "shutdown", "size",
]
