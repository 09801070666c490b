"""Framework-free collectives on numpy arrays: Horovod's API without the frameworks.

Importing this package never imports pyspark, torch or tensorflow.
"""

from hvd_spark.collectives.api import (
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    backend_name,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    cross_rank,
    cross_size,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    init,
    is_initialized,
    local_rank,
    local_size,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    shutdown,
    size,
    synchronize,
)
from hvd_spark.collectives.operations import Handle
from hvd_spark.collectives.ops import Average, Max, Min, Product, ReduceOp, Sum

__all__ = [
    "Average", "Handle", "Max", "Min", "Product", "ReduceOp", "Sum",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "backend_name",
    "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "cross_rank", "cross_size", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "init", "is_initialized", "local_rank", "local_size", "poll",
    "rank", "reducescatter", "reducescatter_async", "shutdown", "size", "synchronize",
]
