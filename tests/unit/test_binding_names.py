"""Both framework bindings expose Horovod's common public names (DESIGN.md: the same names)."""

from __future__ import annotations

import pytest

#: Names that horovod.torch and horovod.tensorflow both export in Horovod 0.28.1.
COMMON = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "start_timeline", "stop_timeline",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier",
    "broadcast_object", "allgather_object", "DistributedOptimizer", "Compression",
    "HorovodInternalError", "HostsUpdatedInterrupt",
]


@pytest.mark.parametrize("module", ["hvd_spark.torch", "hvd_spark.tensorflow"])
def test_binding_exposes_horovods_common_names(module):
    import importlib

    binding = importlib.import_module(module)
    missing = [n for n in COMMON if not hasattr(binding, n)]
    assert missing == []


def test_build_queries_agree_between_bindings():
    import hvd_spark.tensorflow as tf_hvd
    import hvd_spark.torch as torch_hvd

    for name in ["mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
                 "cuda_built", "rocm_built", "mpi_enabled", "gloo_enabled"]:
        assert getattr(torch_hvd, name)() == getattr(tf_hvd, name)(), name
    # Against what is installed here: cupy (the gpu extra) and the NCCL it loads, if any.
    import importlib.util

    has_cupy = importlib.util.find_spec("cupy") is not None
    assert torch_hvd.cuda_built() is has_cupy
    nccl = torch_hvd.nccl_built()
    if not has_cupy:
        assert nccl == 0
    else:
        try:
            from cupy.cuda import nccl as cupy_nccl

            expected = int(cupy_nccl.get_version())
        except Exception:  # no NCCL library or no CUDA driver: Horovod's 0
            expected = 0
        assert nccl == expected
