"""What this build of hvd_spark has, answered the way Horovod's ``*_built`` functions are.

Ported code branches on these (``if hvd.nccl_built(): ...``), so each tells the
truth: bytes move over hvd_spark's own TCP ring and shared memory, on the CPU.
"""

from __future__ import annotations


def mpi_built() -> bool:
    """False: collectives do not run over MPI in this build."""
    return False


def mpi_enabled() -> bool:
    """False: MPI is not in use."""
    return False


def mpi_threads_supported() -> bool:
    """False: there is no MPI (collectives may still be called from several threads)."""
    return False


def gloo_built() -> bool:
    """False: hvd_spark uses its own TCP/shared-memory ring, not Gloo."""
    return False


def gloo_enabled() -> bool:
    """False: Gloo is not in use."""
    return False


def nccl_built() -> int:
    """0: no NCCL backend in this build (Horovod returns NCCL's version number when built)."""
    return 0


def ddl_built() -> bool:
    """False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: Intel oneCCL is not supported."""
    return False


def cuda_built() -> bool:
    """False: collectives reduce on the CPU; CUDA tensors are staged through host memory."""
    return False


def rocm_built() -> bool:
    """False: no ROCm support."""
    return False
