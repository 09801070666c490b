"""Loading cupy, the CUDA runtime and NCCL on first use, and saying what is there.

Every function answers without raising where the libraries are absent: the build
queries (``nccl_built``, ``cuda_built``) and the backend choice call them on CPU-only
machines.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import threading
import warnings
from typing import Any

log = logging.getLogger(__name__)

#: What to install for the device path (the ``gpu`` extra), named in the fallback warning.
GPU_PACKAGES = "pip install 'hvd-spark[gpu]': cupy-cuda12x and nvidia-nccl-cu12"
_warn_lock = threading.Lock()
_warned = False


def cupy_installed() -> bool:
    """True when cupy can be imported (without importing it)."""
    return importlib.util.find_spec("cupy") is not None


@functools.lru_cache(maxsize=1)
def cupy() -> Any:
    """The cupy module (imported on first use).

    Raises:
        ImportError: cupy is not installed or cannot load the CUDA runtime.
    """
    return importlib.import_module("cupy")


@functools.lru_cache(maxsize=1)
def nccl() -> Any:
    """cupy's NCCL bindings (``cupy.cuda.nccl``), NCCL's library loaded.

    Raises:
        ImportError: cupy or NCCL (the nvidia-nccl-cu12 wheel or a system libnccl) is absent.
    """
    module = importlib.import_module("cupy.cuda.nccl")
    if not getattr(module, "available", True):
        raise ImportError("cupy was built without NCCL support")
    return module


def device_count() -> int:
    """CUDA devices visible to this process (0 without cupy or a driver)."""
    if not cupy_installed():
        return 0
    try:
        return int(cupy().cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - any CUDA failure means "no usable GPU"
        log.debug("no CUDA device: %s", exc)
        return 0


def nccl_version() -> int:
    """NCCL's version code (e.g. 22105 for 2.21.5), 0 when NCCL cannot be loaded."""
    if not cupy_installed():
        return 0
    try:
        return int(nccl().get_version())
    except Exception as exc:  # noqa: BLE001 - absent or broken NCCL both mean 0
        log.debug("NCCL is not available: %s", exc)
        return 0


@functools.lru_cache(maxsize=1)
def cupy_problem() -> str | None:
    """Why cupy cannot carry CUDA tensors in this process; None when it loads.

    Tried once per process (a failed import is not retried on every tensor).
    """
    if not cupy_installed():
        return "cupy is not installed"
    try:
        cupy()
    except Exception as exc:  # noqa: BLE001 - ImportError, or CUDA runtime errors on load
        return f"cupy cannot be loaded ({type(exc).__name__}: {exc})"
    return None


def nccl_problem() -> str | None:
    """Why NCCL cannot be loaded in this process; None when it loads."""
    try:
        nccl().get_version()
    except Exception as exc:  # noqa: BLE001 - absent or broken NCCL alike
        return f"NCCL cannot be loaded ({type(exc).__name__}: {exc})"
    return None


def warn_host_staging(problem: str) -> bool:
    """Say once per process, visibly, that CUDA tensors go through host memory and why.

    A ``UserWarning`` (printed on the rank's stderr, which the launchers forward to the
    driver), not a log record: nobody need configure logging to see it.

    Args:
        problem: What is missing, naming the package (e.g. "cupy is not installed").

    Returns:
        Whether this call warned (False after the first time).
    """
    global _warned
    with _warn_lock:
        if _warned:
            return False
        _warned = True
    warnings.warn(
        f"hvd_spark: CUDA tensors are staged through host memory, which is slower: {problem}. "
        f"For NCCL and CUDA IPC install the gpu extra ({GPU_PACKAGES}); "
        "HVD_SPARK_GPU_BACKEND=host chooses host staging without this warning.",
        UserWarning, stacklevel=3)
    return True
