"""Which path a job's CUDA buffers take: NCCL, CUDA IPC, or the host backend.

Pure logic on every rank's (host, GPU) pair, so each rank decides the same from the
same facts. NCCL refuses two ranks on one device (Spark may give tasks fractions of a
GPU), so such ranks reduce through CUDA IPC on their shared device, and the ranks that
lead each device (its lowest rank) run NCCL among themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from hvd_spark import _env
from hvd_spark.errors import BackendUnavailableError, ConfigError

NCCL = "nccl"
HOST = "host"
AUTO = "auto"
_HOROVOD_VALUES = {"nccl": NCCL, "mpi": HOST, "gloo": HOST, "ccl": HOST, "host": HOST}


def gpu_backend_setting() -> str:
    """``nccl``, ``host`` or ``auto``, from HVD_SPARK_GPU_BACKEND or HOROVOD_GPU_OPERATIONS.

    Horovod's ``HOROVOD_GPU_OPERATIONS=NCCL`` means ``nccl``; its MPI, Gloo and oneCCL
    choices mean the host path here (this package has no CUDA-aware MPI path).

    Raises:
        ConfigError: Any other value, naming the variable.
    """
    found = _env.lookup(_env.GPU_BACKEND)
    if found is None:
        return AUTO
    var, raw = found
    value = raw.strip().lower()
    if var == _env.GPU_BACKEND:
        if value in (NCCL, HOST, AUTO, ""):
            return value or AUTO
        raise ConfigError(f"{var}={raw!r} is not a GPU backend; use nccl, host or auto")
    if value in _HOROVOD_VALUES:
        return _HOROVOD_VALUES[value]
    raise ConfigError(f"{var}={raw!r} is not one of Horovod's GPU operations (NCCL, MPI, GLOO, "
                      f"CCL); or set {_env.GPU_BACKEND}=nccl|host|auto")


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """How one rank's device buffers travel.

    Attributes:
        mode: ``nccl`` (every rank its own GPU), ``ipc`` (all ranks share one GPU),
            ``ipc+nccl`` (IPC among the ranks of a GPU, NCCL among the GPUs' leaders),
            or ``host`` (staged through host memory).
        ipc_group: Global ranks sharing this rank's GPU, ascending (itself included).
        leaders: The lowest rank of every GPU, ascending: the NCCL communicator's ranks.
        reason: Why, for the log and for errors.
    """

    mode: str
    ipc_group: tuple[int, ...]
    leaders: tuple[int, ...]
    reason: str

    @property
    def leader(self) -> int:
        """The rank of this rank's GPU that talks NCCL for it."""
        return self.ipc_group[0]


def plan(rank: int, devices: Mapping[int, tuple[str, str]], setting: str,
         nccl_ok: bool, ipc_ok: bool = True) -> DevicePlan:
    """Decide this rank's path from every rank's ``(hostname, GPU UUID)``.

    Args:
        rank: This rank.
        devices: Every rank's host and the UUID of its current CUDA device.
        setting: ``gpu_backend_setting()``.
        nccl_ok: NCCL can be loaded on this rank.
        ipc_ok: CUDA IPC is allowed (it is not on some virtualized GPUs).

    Raises:
        BackendUnavailableError: ``nccl`` was asked for and cannot serve this job.
    """
    by_device: dict[tuple[str, str], list[int]] = {}
    for r in sorted(devices):
        by_device.setdefault(devices[r], []).append(r)
    group = tuple(by_device[devices[rank]])
    leaders = tuple(sorted(ranks[0] for ranks in by_device.values()))
    if setting == HOST:
        return DevicePlan(HOST, (rank,), (), "HVD_SPARK_GPU_BACKEND=host")
    shared = [ranks for ranks in by_device.values() if len(ranks) > 1]
    problem = None
    if not nccl_ok and len(leaders) > 1:
        problem = "NCCL cannot be loaded (install the gpu extra: cupy-cuda12x, nvidia-nccl-cu12)"
    elif shared and not ipc_ok:
        problem = (f"ranks {shared[0]} share one GPU, which NCCL refuses, and CUDA IPC is not "
                   "available between them")
    if problem is not None:
        if setting == NCCL:
            raise BackendUnavailableError(f"{_env.GPU_BACKEND}=nccl cannot be honoured: {problem}")
        return DevicePlan(HOST, (rank,), (), problem)
    if not shared:
        return DevicePlan(NCCL, (rank,), leaders, "every rank has its own GPU")
    mode = "ipc" if len(leaders) == 1 else "ipc+nccl"
    return DevicePlan(mode, group, leaders,
                      f"{len(devices)} ranks on {len(leaders)} GPU(s): CUDA IPC among the ranks "
                      "of a GPU" + (", NCCL among GPUs" if len(leaders) > 1 else ""))
