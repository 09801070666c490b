"""Backend name -> factory, imported lazily so unused backends cost nothing."""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
from collections.abc import Callable

from hvd_spark import _env
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.config import EngineConfig, WorldInfo
from hvd_spark.errors import BackendUnavailableError, ConfigError

# factory(world, config, data_socks) -> Communicator
Factory = Callable[[WorldInfo, EngineConfig, dict[int, socket.socket]], Communicator]

_BACKENDS: dict[str, str] = {
    "tcp": "hvd_spark.collectives.tcp.factory:create",
    "mpi": "hvd_spark.collectives.mpi:create",
}
# Backends that form the job themselves, their launcher having started the ranks (mpirun):
# start(config) -> (WorldInfo, engine, {rank: hostname}).
_OWN_WORLD: dict[str, str] = {"mpi": "hvd_spark.collectives.mpi.world:start"}
# What Open MPI, MPICH/Hydra and PMIx launchers set in every rank's environment.
_MPI_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def register(name: str, target: str) -> None:
    """Register ``module:function`` as the factory of backend ``name``.

    Registering the same target again does nothing (a module imported twice).

    Raises:
        ConfigError: ``name`` is ``auto`` or names a backend with another factory
            already (a second backend would replace the first silently), or ``target``
            is not ``module:function``.
    """
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ConfigError(f"backend {name!r}: the factory must be given as 'module:function', "
                          f"not {target!r}")
    known = _BACKENDS.get(name)
    if name == "auto" or (known is not None and known != target):
        raise ConfigError(
            f"a collectives backend named {name!r} is registered already "
            f"({known or 'auto picks tcp or mpi'}); register {target!r} under another name")
    _BACKENDS[name] = target


def names() -> list[str]:
    """Registered backend names."""
    return sorted(_BACKENDS)


def launched_by_mpirun() -> bool:
    """True in a process an MPI launcher started, and not one of our launchers (whose
    variables win: hvdrun inside an MPI allocation still means TCP)."""
    if any(_env.get_str(var) for var in _env.LAUNCHER_VARS):
        return False
    return any(var in os.environ for var in _MPI_LAUNCHER_VARS)


def is_mpi_communicator(comm: object) -> bool:
    """True for an mpi4py communicator (Horovod's ``init(comm=...)``), without importing it."""
    return comm is not None and type(comm).__module__.startswith("mpi4py")


def own_world(name: str, mpi_comm: object = None) -> Callable | None:
    """The job-forming ``start`` of backend ``name``, or None for backends joining a mesh.

    "auto" means MPI in processes started by mpirun (as Horovod's ``mpirun python
    train.py``) when mpi4py is installed, TCP elsewhere.

    Raises:
        ConfigError: ``mpi_comm`` was given but this job does not run over MPI.
    """
    if mpi_comm is not None and name == "auto":
        name = "mpi"
    # An MPI process is enough here: hvdrun --mpi's ranks also carry our launcher's
    # variables (to report back to it), which launched_by_mpirun reads as "not mpirun's".
    in_mpi = any(var in os.environ for var in _MPI_LAUNCHER_VARS)
    if mpi_comm is not None and (name != "mpi" or not in_mpi):
        raise ConfigError(
            "init(comm=<MPI communicator>) needs ranks started by mpirun (hvdrun --mpi or "
            f"mpirun) and the mpi backend ({_env.BACKEND}={name!r} here)")
    if name == "auto":
        mpi = launched_by_mpirun() and importlib.util.find_spec("mpi4py") is not None
        name = "mpi" if mpi else "tcp"
    target = _OWN_WORLD.get(name)
    return None if target is None else _load(name, target)


def resolve(name: str) -> Factory:
    """Return the factory for ``name`` ("auto" picks tcp on CPU)."""
    if name == "auto":
        name = "tcp"
    target = _BACKENDS.get(name)
    if target is None:
        raise ConfigError(
            f"unknown collectives backend {name!r}; HVD_SPARK_BACKEND must be one of "
            f"{['auto', *names()]}"
        )
    return _with_device_path(_load(name, target))


def _with_device_path(factory: Factory) -> Factory:
    """The factory, its communicator sending CUDA buffers down a device path (NCCL/IPC)
    where cupy is installed and HVD_SPARK_GPU_BACKEND is not ``host``."""
    def create(world: WorldInfo, config: EngineConfig,
               data_socks: dict[int, socket.socket]) -> Communicator:
        from hvd_spark.collectives.nccl import device

        return device.wrap(factory(world, config, data_socks), world.hostname)

    return create


def _load(name: str, target: str) -> Callable:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(f"backend {name!r} cannot be imported: {exc}") from exc
    return getattr(module, attr)
