"""What this build of hvd_spark has, answered the way Horovod's ``*_built`` functions are.

Ported code branches on these (``if hvd.nccl_built(): ...``), so each tells the
truth: bytes move over hvd_spark's own TCP ring and shared memory on the CPU, or over
MPI in ranks started by mpirun when mpi4py is installed; CUDA buffers over NCCL or
CUDA IPC when cupy (and NCCL) are installed.
"""

from __future__ import annotations

import importlib.util
import sys

from hvd_spark.collectives import session


def mpi_built() -> bool:
    """True when the MPI backend can run here (mpi4py is installed)."""
    return importlib.util.find_spec("mpi4py") is not None


def _mpi_in_use() -> bool:
    engine = session.current_engine()
    return engine is not None and engine.comm.name == "mpi"


def mpi_enabled() -> bool:
    """True while this job's collectives run over MPI (started by mpirun / hvdrun --mpi)."""
    return _mpi_in_use()


def mpi_threads_supported() -> bool:
    """True when MPI is in use with MPI_THREAD_MULTIPLE (collectives work from any thread
    on every backend: the engine's own thread is the only one calling MPI)."""
    if not _mpi_in_use():
        return False
    mpi = sys.modules["mpi4py.MPI"]
    return mpi.Query_thread() == mpi.THREAD_MULTIPLE


def gloo_built() -> bool:
    """False: hvd_spark uses its own TCP/shared-memory ring, not Gloo."""
    return False


def gloo_enabled() -> bool:
    """False: Gloo is not in use."""
    return False


def nccl_built() -> int:
    """NCCL's version code (e.g. 22105) when CUDA tensors can go through NCCL here (cupy
    and NCCL load), else 0, as Horovod returns its NCCL version or 0."""
    from hvd_spark.collectives.nccl import library

    return library.nccl_version()


def ddl_built() -> bool:
    """False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: Intel oneCCL is not supported."""
    return False


def cuda_built() -> bool:
    """True when collectives can work on CUDA device memory here (cupy is installed:
    NCCL or CUDA IPC, else staging through the host); False on CPU-only installs."""
    from hvd_spark.collectives.nccl import library

    return library.cupy_installed()


def rocm_built() -> bool:
    """False: no ROCm support."""
    return False
