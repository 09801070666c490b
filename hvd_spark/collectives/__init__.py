"""Framework-free collectives on numpy arrays: Horovod's API without the frameworks.

Importing this package never imports pyspark, torch or tensorflow, and imports nothing
until a name is first used: a rank's process that only reports through
``collectives.tcp`` (``hvd_spark.runner.worker``) does not pay for the whole API.
"""

from __future__ import annotations

import importlib
from typing import Any

# Where each public name lives (``elastic`` is a submodule): the one list of the API.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "hvd_spark.collectives.elastic": ("elastic",),
    "hvd_spark.collectives.api": ("add_process_set", "allgather", "allgather_async",
        "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
        "allreduce_many_async_", "alltoall", "alltoall_async", "auto_name", "backend_name",
        "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
        "broadcast_object", "cross_rank", "cross_size", "group_base_name", "grouped_allgather",
        "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
        "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
        "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
        "local_rank", "local_size", "poll", "rank", "reducescatter", "reducescatter_async",
        "remove_process_set", "report_failure", "report_grouped_failure", "shutdown", "size",
        "start_timeline", "stop_timeline", "synchronize",),
    "hvd_spark.collectives.build_info": ("ccl_built", "cuda_built", "ddl_built", "gloo_built",
        "gloo_enabled", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
        "rocm_built",),
    "hvd_spark.collectives.operations": ("Handle",),
    "hvd_spark.collectives.ops": ("Adasum", "Average", "Max", "Min", "Product", "ReduceOp", "Sum",),
    "hvd_spark.collectives.process_sets": ("ProcessSet", "global_process_set",),
    "hvd_spark.errors": ("HorovodInternalError", "HostsUpdatedInterrupt",),
}
_SOURCES = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_SOURCES)


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
