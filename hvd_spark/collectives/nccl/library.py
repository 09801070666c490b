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
from typing import Any

log = logging.getLogger(__name__)


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
