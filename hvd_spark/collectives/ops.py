"""Reduction operations and the dtypes the collectives accept.

Pure numpy; the names (Sum, Average, ...) are the ones Horovod users know.
"""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np

from hvd_spark.errors import CollectiveArgumentError


class ReduceOp(enum.IntEnum):
    """How allreduce/reducescatter combine the ranks' values."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

#: dtypes every collective moves; reductions also accept all of them (bool: or/and).
SUPPORTED_DTYPES: frozenset[np.dtype] = frozenset(
    np.dtype(t)
    for t in (
        np.float16,
        BFLOAT16,
        np.float32,
        np.float64,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.bool_,
    )
)

_UFUNCS = {
    ReduceOp.Average: np.add,
    ReduceOp.Sum: np.add,
    ReduceOp.Min: np.minimum,
    ReduceOp.Max: np.maximum,
    ReduceOp.Product: np.multiply,
}

_HALF = (np.dtype(np.float16), BFLOAT16)


def is_floating(dtype: np.dtype) -> bool:
    """True for float16/bfloat16/float32/float64."""
    return dtype == BFLOAT16 or np.issubdtype(dtype, np.floating)


def check_dtype(dtype: np.dtype, name: str) -> None:
    """Raise CollectiveError when ``dtype`` cannot travel through the collectives."""
    if np.dtype(dtype) not in SUPPORTED_DTYPES:
        raise CollectiveArgumentError(
            f"tensor {name!r} has dtype {dtype}, which hvd_spark collectives do not support; "
            "use a float, int, uint or bool dtype"
        )


def check_reduction(dtype: np.dtype, op: ReduceOp, prescale: float, postscale: float, name: str):
    """Raise CollectiveError for reductions that make no sense for ``dtype``."""
    check_dtype(dtype, name)
    if dtype == np.bool_ and op == ReduceOp.Average:
        raise CollectiveArgumentError(
            f"tensor {name!r} is bool: Average is undefined; use Sum (or), Min/Product (and), Max"
        )
    if dtype == np.bool_ and (prescale != 1.0 or postscale != 1.0):
        raise CollectiveArgumentError(
            f"tensor {name!r} is bool: prescale_factor/postscale_factor do not apply to it")
    if op == ReduceOp.Adasum and not is_floating(dtype):
        raise CollectiveArgumentError(
            f"tensor {name!r} has dtype {dtype}: Adasum combines floating-point tensors only")


def reduce_into(dst: np.ndarray, src: np.ndarray, op: ReduceOp,
                base: np.ndarray | None = None) -> None:
    """``dst = op(base, src)`` element-wise (``base`` defaults to ``dst`` itself: in place).

    Average sums; the caller scales afterwards.
    """
    _UFUNCS[op](dst if base is None else base, src, out=dst)


def scale_in_place(arr: np.ndarray, factor: float) -> None:
    """Multiply ``arr`` by ``factor`` in place (no-op for 1.0), as Horovod computes it.

    float32/float64 scale in their own precision; float16/bfloat16 in float32; integers
    in float64, then truncated toward zero.
    """
    if factor == 1.0:
        return
    if arr.dtype in _HALF:
        arr[...] = (arr.astype(np.float32) * np.float32(factor)).astype(arr.dtype)
    elif is_floating(arr.dtype):
        np.multiply(arr, factor, out=arr, casting="unsafe")
    else:
        arr[...] = (arr.astype(np.float64) * factor).astype(arr.dtype)


def finish_average(arr: np.ndarray, size: int) -> None:
    """Turn a sum over ``size`` ranks into the average (integers truncate toward zero)."""
    scale_in_place(arr, 1.0 / size)
