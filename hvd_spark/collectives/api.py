"""The framework-free collectives API on numpy arrays (Horovod's names and semantics).

This module is the public surface only: it gathers the names that the modules below
define, each doing one job:

- ``session``: the process's session state (world, engine, generation) and its accessors
  (``rank()``, ``size()``, ...);
- ``bootstrap``: joining and leaving the job (``init``, ``shutdown``), the heartbeat and
  the timeline;
- ``submit``: naming, submitting and waiting for operations (``synchronize``, ``poll``);
- ``reduce_ops``: allreduce and reducescatter, plain, batched and grouped;
- ``gather_ops``: allgather, broadcast, alltoall, the object forms, barrier and join;
- ``process_set_registry``: ``add_process_set`` and ``remove_process_set``.

Its ``__all__`` is the one list of ``hvd_spark.collectives``' names (with the ``elastic``
submodule). What only the bindings need (operation names, failure reports, the engine)
is in ``_plumbing``.

Configuration comes from the environment the launchers set; users only call
``init()``. Every blocking call has a deadline (HVD_SPARK_TIMEOUT).
"""

from __future__ import annotations

from hvd_spark.collectives.bootstrap import init, shutdown, start_timeline, stop_timeline
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
from hvd_spark.collectives.gather_ops import (
    allgather,
    allgather_async,
    allgather_object,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allgather,
    grouped_allgather_async,
    join,
)
from hvd_spark.collectives.operations import Handle
from hvd_spark.collectives.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from hvd_spark.collectives.process_set_registry import add_process_set, remove_process_set
from hvd_spark.collectives.process_sets import ProcessSet, global_process_set
from hvd_spark.collectives.reduce_ops import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    allreduce_many_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from hvd_spark.collectives.session import (
    backend_name,
    cross_rank,
    cross_size,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    size,
)
from hvd_spark.collectives.submit import poll, synchronize
from hvd_spark.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = [
    "Adasum", "Average", "Handle", "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min",
    "ProcessSet", "Product", "ReduceOp", "Sum", "add_process_set", "allgather", "allgather_async",
    "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "allreduce_many_async_", "alltoall", "alltoall_async", "backend_name", "barrier", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled",
    "global_process_set", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
    "synchronize",
]
