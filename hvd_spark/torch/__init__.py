"""Horovod's PyTorch API on hvd_spark: ``import hvd_spark.torch as hvd``.

Code written for ``horovod.torch`` ports by changing that import. Collectives run
in hvd_spark's background engine on numpy views of CPU tensors (CUDA tensors are
staged through CPU copies).
"""

from hvd_spark.collectives import (
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
from hvd_spark.torch.compression import Compression, Compressor
from hvd_spark.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hvd_spark.torch.mpi_ops import (
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
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from hvd_spark.torch.optimizer import DistributedOptimizer
from hvd_spark.torch.sync_batch_norm import SyncBatchNorm


def mpi_built() -> bool:
    """False: hvd_spark moves bytes over TCP/shared memory, not MPI (Horovod compatibility)."""
    return False


def nccl_built() -> bool:
    """False: no NCCL backend in this build (Horovod compatibility)."""
    return False


def cuda_built() -> bool:
    """False: collectives run on the CPU; CUDA tensors are staged (Horovod compatibility)."""
    return False


__all__ = [
    "Average", "Compression", "Compressor", "DistributedOptimizer", "Max", "Min", "Product",
    "ReduceOp", "Sum", "SyncBatchNorm", "allgather", "allgather_async", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "cross_rank", "cross_size", "cuda_built", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "init", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "shutdown", "size", "synchronize",
]
