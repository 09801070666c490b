"""Horovod's TensorFlow/Keras API on hvd_spark: change the import, keep the code.

``import hvd_spark.tensorflow as hvd`` (or ``hvd_spark.tensorflow.keras``, or
``hvd_spark.keras``: same names) gives ``init``, ``rank``, ``size``, tensor
collectives that work eagerly, inside ``tf.function`` and in TF1-style sessions,
process sets, ``DistributedGradientTape``, ``DistributedOptimizer`` for Keras 3
optimizers, ``SyncBatchNormalization``, ``callbacks``, ``elastic`` training (``hvd.elastic.run``,
the states, the Keras callbacks) and ``Compression``.
"""

from __future__ import annotations

from hvd_spark import _loaders
from hvd_spark.collectives import (
    Adasum,
    Average,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    ProcessSet,
    Product,
    ReduceOp,
    Sum,
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
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from hvd_spark.tensorflow import callbacks, elastic
from hvd_spark.tensorflow.compression import Compression, Compressor
from hvd_spark.tensorflow.functions import (
    add_process_set,
    allgather_object,
    barrier,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
    init,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    remove_process_set,
    size_op,
)
from hvd_spark.tensorflow.gather_ops import (
    allgather,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
)
from hvd_spark.tensorflow.gradient_tape import (
    DistributedGradientTape,
    PartialDistributedGradientTape,
)
from hvd_spark.tensorflow.kernel import executing_eagerly as _executing_eagerly  # noqa: F401
from hvd_spark.tensorflow.ops import (
    allreduce,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from hvd_spark.tensorflow.optimizer import (
    DistributedOptimizer,
    PartialDistributedOptimizer,
    load_model,
)
from hvd_spark.tensorflow.sync_batch_norm import SyncBatchNormalization

__all__ = [
    "Adasum", "Average", "Compression", "Compressor", "DistributedGradientTape",
    "DistributedOptimizer", "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min",
    "PartialDistributedGradientTape", "PartialDistributedOptimizer", "ProcessSet", "Product",
    "ReduceOp", "Sum",
    "SyncBatchNormalization", "add_process_set", "allgather", "allgather_object", "allreduce",
    "alltoall", "barrier", "broadcast", "broadcast_", "broadcast_global_variables",
    "broadcast_object", "broadcast_object_fn", "broadcast_variables", "callbacks", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic", "gloo_built",
    "gloo_enabled", "global_process_set", "grouped_allgather", "grouped_allreduce",
    "grouped_reducescatter", "init", "is_homogeneous", "is_initialized", "join", "load_model",
    "local_rank", "local_rank_op", "local_size", "local_size_op", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "process_set_included_op", "rank", "rank_op",
    "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size", "size_op",
    "start_timeline", "stop_timeline",
]


def _tf_dataset(stream: object) -> object:
    # Converter.make_tf_dataset's dataset; its module loads on first use.
    from hvd_spark.tensorflow.data import TFDatasetContext

    return TFDatasetContext(stream)


# The data layer imports no binding: it finds the dataset here (hvd_spark/_loaders.py).
_loaders.register("tensorflow", _tf_dataset)
