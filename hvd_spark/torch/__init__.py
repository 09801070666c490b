"""Horovod's PyTorch API on hvd_spark: ``import hvd_spark.torch as hvd``.

Code written for ``horovod.torch`` ports by changing that import. Collectives run
in hvd_spark's background engine on numpy views of CPU tensors; CUDA tensors stay on the
GPU (NCCL or CUDA IPC) with the ``gpu`` extra, and are staged through host memory without it.
"""

from hvd_spark import _loaders
from hvd_spark.collectives import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ProcessSet,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from hvd_spark.torch import elastic  # noqa: E402 - needs the names above
from hvd_spark.torch.compression import Compression, Compressor
from hvd_spark.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    init,
)
from hvd_spark.torch.mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from hvd_spark.torch.optimizer import DistributedOptimizer
from hvd_spark.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    "elastic",
    "Adasum", "Average", "Compression", "Compressor", "DistributedOptimizer",
    "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min", "ProcessSet", "Product",
    "ReduceOp", "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async",
    "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built",
    "gloo_enabled", "global_process_set", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async", "init",
    "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]


def _torch_loader(stream: object, device: object = None) -> object:
    # Converter.make_torch_dataloader's loader. Its module (with pyarrow's reader) loads on
    # first use, not with the binding.
    from hvd_spark.torch.data import TorchLoader

    return TorchLoader(stream, device)


# The data layer imports no binding: it finds the loader here (hvd_spark/_loaders.py).
_loaders.register("torch", _torch_loader)
