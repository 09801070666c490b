"""Framework-free collectives on numpy arrays: Horovod's API without the frameworks.

Importing this package never imports pyspark, torch or tensorflow, and imports nothing
until a name is first used: a rank's process that only reports through
``collectives.tcp`` (``hvd_spark.runner.worker``) does not pay for the whole API.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
        group_base_name,
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

# Where each public name lives (``elastic`` is a submodule).
_SOURCES: dict[str, str] = {
    "elastic": "hvd_spark.collectives.elastic",
    "add_process_set": "hvd_spark.collectives.api",
    "allgather": "hvd_spark.collectives.api",
    "allgather_async": "hvd_spark.collectives.api",
    "allgather_object": "hvd_spark.collectives.api",
    "allreduce": "hvd_spark.collectives.api",
    "allreduce_": "hvd_spark.collectives.api",
    "allreduce_async": "hvd_spark.collectives.api",
    "allreduce_async_": "hvd_spark.collectives.api",
    "allreduce_many_async_": "hvd_spark.collectives.api",
    "alltoall": "hvd_spark.collectives.api",
    "alltoall_async": "hvd_spark.collectives.api",
    "auto_name": "hvd_spark.collectives.api",
    "backend_name": "hvd_spark.collectives.api",
    "barrier": "hvd_spark.collectives.api",
    "broadcast": "hvd_spark.collectives.api",
    "broadcast_": "hvd_spark.collectives.api",
    "broadcast_async": "hvd_spark.collectives.api",
    "broadcast_async_": "hvd_spark.collectives.api",
    "broadcast_object": "hvd_spark.collectives.api",
    "cross_rank": "hvd_spark.collectives.api",
    "cross_size": "hvd_spark.collectives.api",
    "group_base_name": "hvd_spark.collectives.api",
    "grouped_allgather": "hvd_spark.collectives.api",
    "grouped_allgather_async": "hvd_spark.collectives.api",
    "grouped_allreduce": "hvd_spark.collectives.api",
    "grouped_allreduce_": "hvd_spark.collectives.api",
    "grouped_allreduce_async": "hvd_spark.collectives.api",
    "grouped_allreduce_async_": "hvd_spark.collectives.api",
    "grouped_reducescatter": "hvd_spark.collectives.api",
    "grouped_reducescatter_async": "hvd_spark.collectives.api",
    "init": "hvd_spark.collectives.api",
    "is_homogeneous": "hvd_spark.collectives.api",
    "is_initialized": "hvd_spark.collectives.api",
    "join": "hvd_spark.collectives.api",
    "local_rank": "hvd_spark.collectives.api",
    "local_size": "hvd_spark.collectives.api",
    "poll": "hvd_spark.collectives.api",
    "rank": "hvd_spark.collectives.api",
    "reducescatter": "hvd_spark.collectives.api",
    "reducescatter_async": "hvd_spark.collectives.api",
    "remove_process_set": "hvd_spark.collectives.api",
    "report_failure": "hvd_spark.collectives.api",
    "report_grouped_failure": "hvd_spark.collectives.api",
    "shutdown": "hvd_spark.collectives.api",
    "size": "hvd_spark.collectives.api",
    "start_timeline": "hvd_spark.collectives.api",
    "stop_timeline": "hvd_spark.collectives.api",
    "synchronize": "hvd_spark.collectives.api",
    "ccl_built": "hvd_spark.collectives.build_info",
    "cuda_built": "hvd_spark.collectives.build_info",
    "ddl_built": "hvd_spark.collectives.build_info",
    "gloo_built": "hvd_spark.collectives.build_info",
    "gloo_enabled": "hvd_spark.collectives.build_info",
    "mpi_built": "hvd_spark.collectives.build_info",
    "mpi_enabled": "hvd_spark.collectives.build_info",
    "mpi_threads_supported": "hvd_spark.collectives.build_info",
    "nccl_built": "hvd_spark.collectives.build_info",
    "rocm_built": "hvd_spark.collectives.build_info",
    "Handle": "hvd_spark.collectives.operations",
    "Adasum": "hvd_spark.collectives.ops",
    "Average": "hvd_spark.collectives.ops",
    "Max": "hvd_spark.collectives.ops",
    "Min": "hvd_spark.collectives.ops",
    "Product": "hvd_spark.collectives.ops",
    "ReduceOp": "hvd_spark.collectives.ops",
    "Sum": "hvd_spark.collectives.ops",
    "ProcessSet": "hvd_spark.collectives.process_sets",
    "global_process_set": "hvd_spark.collectives.process_sets",
    "HorovodInternalError": "hvd_spark.errors",
    "HostsUpdatedInterrupt": "hvd_spark.errors",
}

__all__ = [
    "elastic",
    "Adasum", "Average", "Handle", "HorovodInternalError", "HostsUpdatedInterrupt", "Max",
    "Min", "ProcessSet", "Product", "ReduceOp", "Sum", "add_process_set", "allgather",
    "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "allreduce_many_async_", "alltoall", "alltoall_async", "auto_name",
    "backend_name", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "gloo_built", "gloo_enabled", "global_process_set", "group_base_name", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async", "remove_process_set",
    "report_failure", "report_grouped_failure", "rocm_built", "shutdown", "size",
    "start_timeline", "stop_timeline", "synchronize",
]



def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'hvd_spark.collectives' has no attribute {name!r}")
    module = importlib.import_module(source)
    value = module if name == "elastic" else getattr(module, name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
