"""Framework-free collectives on numpy arrays: Horovod's API without the frameworks.

Importing this package never imports pyspark, torch or tensorflow.
"""

from hvd_spark.collectives import elastic
from hvd_spark.collectives.api import (
    add_process_set,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    allreduce_many_async_,
    alltoall,
    alltoall_async,
    auto_name,
    backend_name,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    cross_rank,
    cross_size,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    report_failure,
    report_grouped_failure,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    synchronize,
)
from hvd_spark.collectives.build_info import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from hvd_spark.collectives.operations import Handle
from hvd_spark.collectives.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from hvd_spark.collectives.process_sets import ProcessSet, global_process_set
from hvd_spark.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = [
    "elastic",
    "Adasum", "Average", "Handle", "HorovodInternalError", "HostsUpdatedInterrupt", "Max",
    "Min", "ProcessSet", "Product", "ReduceOp", "Sum", "add_process_set", "allgather",
    "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "allreduce_many_async_", "alltoall", "alltoall_async", "auto_name",
    "backend_name", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "gloo_built", "gloo_enabled", "global_process_set", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async", "remove_process_set",
    "report_failure", "report_grouped_failure", "rocm_built", "shutdown", "size",
    "start_timeline", "stop_timeline", "synchronize",
]
