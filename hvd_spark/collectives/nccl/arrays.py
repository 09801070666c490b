"""Telling device arrays from host arrays, and the few array helpers the paths share.

A device array is anything exposing ``__cuda_array_interface__`` (cupy arrays here);
cupy is imported only when one is met.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hvd_spark.collectives import engine_core
from hvd_spark.collectives.nccl import library

CPU = "cpu"
CUDA = "cuda"


def is_device(array: Any) -> bool:
    """True for a CUDA array (``__cuda_array_interface__``), False for host arrays."""
    return hasattr(array, "__cuda_array_interface__")


def device_of(array: Any) -> str:
    """``cuda`` or ``cpu``: the Request.device of an operation on ``array``."""
    return CUDA if is_device(array) else CPU


def zeros(shape: tuple[int, ...], dtype: Any, device: str) -> Any:
    """Zeros where an operation's tensors live (a joined rank's stand-in tensor)."""
    if device == CUDA:
        return library.cupy().zeros(shape, dtype)
    return np.zeros(shape, dtype)


def to_host(array: Any) -> np.ndarray:
    """A host copy of a device array (waits for the copy: used off the hot path)."""
    return library.cupy().asnumpy(array)


def copy_into(dst: Any, src: Any) -> None:
    """``dst[...] = src`` across host and device (either side may be either)."""
    if is_device(dst):
        if is_device(src):
            dst[...] = src
        else:
            dst.set(np.ascontiguousarray(src).reshape(dst.shape))
    elif is_device(src):
        dst[...] = to_host(src).reshape(dst.shape)
    else:
        dst[...] = src


# Joined ranks stand in with zeros where the operation's tensors live.
engine_core.register_zeros(CUDA, lambda shape, dtype: library.cupy().zeros(shape, dtype))
