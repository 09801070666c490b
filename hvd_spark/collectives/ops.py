"""Reduction operations and the dtypes the collectives accept.

Pure numpy; the names (Sum, Average, ...) are the ones Horovod users know.

float16 and bfloat16 reduce and scale in float32, rounding back once per step (as
Horovod does). bfloat16 (and float16 scaling) go a cache-sized chunk at a time through
per-thread float32 scratch; float16 reductions use numpy's own loops, which compute
the same way, because numpy's float16 casts are scalar and no faster. A framework
binding may lend vectorised kernels for both (:func:`register_half_kernels`); they
must round the same way, and numpy stays the default and the fallback.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Callable, Sequence
from typing import Any

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

_FLOAT16 = np.dtype(np.float16)
_HALF = frozenset((_FLOAT16, BFLOAT16))
# A set lookup: np.issubdtype costs about 2 us, paid several times per small allreduce.
_FLOATING = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64, np.longdouble,
                                             BFLOAT16))

#: Elements per float32 scratch chunk: two 256 KB buffers stay in L2 while reduced.
HALF_CHUNK = 1 << 16

_scratch = threading.local()


@dataclasses.dataclass(frozen=True)
class HalfKernels:
    """float16/bfloat16 kernels a framework binding lends the collectives.

    Both receive 1-D C-contiguous arrays of one half dtype and equal size (``reduce``'s
    ``src`` and ``base`` may be read-only: a caller's input), and return False to decline
    (numpy then does the work). They must compute as the numpy
    path does: in float32, rounded to nearest even once per call.

    Attributes:
        name: Shown by :func:`half_kernels_name` (e.g. ``"torch"``).
        reduce: ``reduce(dst, src, op, base) -> bool``: ``dst = op(base, src)``,
            ``base`` is ``dst`` when the caller gave none; Average sums.
        scale: ``scale(arr, factor) -> bool``: ``arr *= float32(factor)``.
    """

    name: str
    reduce: Callable[[np.ndarray, np.ndarray, ReduceOp, np.ndarray], bool]
    scale: Callable[[np.ndarray, float], bool]


_half_kernels: HalfKernels | None = None


def register_half_kernels(kernels: HalfKernels | None) -> HalfKernels | None:
    """Use ``kernels`` for float16/bfloat16 from now on (None: back to numpy).

    Returns:
        The kernels registered before, so a caller (or a test) can restore them.
    """
    global _half_kernels
    previous, _half_kernels = _half_kernels, kernels
    return previous


def half_kernels_name() -> str:
    """Who reduces float16/bfloat16 now: ``"numpy"`` or the registered kernels' name."""
    kernels = _half_kernels
    return "numpy" if kernels is None else kernels.name


class HalfKernelRegistration:
    """How a binding registers its :class:`HalfKernels`: now, once per process, or undone.

    Args:
        kernels: The binding's kernels.
        replace: Whether they replace kernels another binding registered before (torch's
            do; TensorFlow's yield to them, which are faster).
    """

    def __init__(self, kernels: HalfKernels, replace: bool = True) -> None:
        self.kernels = kernels
        self.replace = replace
        self._done = False

    def register(self) -> None:
        """Reduce and scale half-precision arrays with these kernels from now on (in this
        process), unless ``replace`` is False and another binding's are registered."""
        if self.replace or half_kernels_name() == "numpy":
            register_half_kernels(self.kernels)

    def register_once(self) -> None:
        """:meth:`register` on this process's first call only (the binding's ``init()``
        calls it), so that a later :meth:`unregister` or ``register_half_kernels`` stays."""
        if not self._done:
            self._done = True
            self.register()

    def unregister(self) -> None:
        """Go back to the numpy kernels if these are the registered ones."""
        if half_kernels_name() == self.kernels.name:
            register_half_kernels(None)


def is_floating(dtype: np.dtype) -> bool:
    """True for float16/bfloat16/float32/float64."""
    if not isinstance(dtype, np.dtype):
        dtype = np.dtype(dtype)
    return dtype in _FLOATING


def array_of(value: Any) -> np.ndarray | None:
    """``value`` as a numpy array when it is one or a Python/numpy scalar, else None (a
    framework tensor or anything else, which the caller rejects in its own words)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (int, float, bool, np.generic)):
        return np.asarray(value)
    return None


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

    Average sums; the caller scales afterwards. float16/bfloat16 compute in float32
    and round once (see the module docstring).
    """
    if dst.dtype in _HALF:
        _reduce_half(dst, src, op, dst if base is None else base)
    else:
        _UFUNCS[op](dst if base is None else base, src, out=dst)


def _flat(arr: np.ndarray, size: int) -> np.ndarray | None:
    """A 1-D view of ``arr`` when it is contiguous with ``size`` elements, else None."""
    if arr.size != size or not arr.flags.c_contiguous:
        return None
    return arr.reshape(-1)


def _scratch_f32() -> tuple[np.ndarray, np.ndarray]:
    # Per thread: the engine thread and callers reducing eagerly may run at once.
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = (np.empty(HALF_CHUNK, np.float32),
                                np.empty(HALF_CHUNK, np.float32))
    return bufs


def _reduce_half(dst: np.ndarray, src: np.ndarray, op: ReduceOp, base: np.ndarray) -> None:
    ufunc = _UFUNCS[op]
    n = dst.size
    d, s, b = _flat(dst, n), _flat(src, n), _flat(base, n)
    if d is None or s is None or b is None or src.dtype != dst.dtype or base.dtype != dst.dtype:
        # Strided or broadcast: numpy's own half ufuncs also compute in float32 and
        # round once, element by element (slow, but the hot paths never get here).
        ufunc(base, src, out=dst)
        return
    kernels = _half_kernels
    if kernels is not None and kernels.reduce(d, s, op, b):
        return
    if dst.dtype == _FLOAT16:
        # numpy converts float16 one element at a time (~2-3 ns each way): upcasting
        # into scratch costs more than its own loop, which also computes in float32
        # and rounds once.
        ufunc(b, s, out=d)
        return
    fa, fs = _scratch_f32()
    for start in range(0, n, HALF_CHUNK):
        stop = min(start + HALF_CHUNK, n)
        a32, s32 = fa[: stop - start], fs[: stop - start]
        np.copyto(a32, b[start:stop], casting="unsafe")
        np.copyto(s32, s[start:stop], casting="unsafe")
        ufunc(a32, s32, out=a32)
        np.copyto(d[start:stop], a32, casting="unsafe")  # the one rounding


def scale_in_place(arr: np.ndarray, factor: float) -> None:
    """Multiply ``arr`` by ``factor`` in place (no-op for 1.0), as Horovod computes it.

    float32/float64 scale in their own precision; float16/bfloat16 in float32; integers
    in float64, then truncated toward zero.
    """
    if factor == 1.0:
        return
    if arr.dtype in _HALF:
        _scale_half(arr, factor)
    elif is_floating(arr.dtype):
        np.multiply(arr, factor, out=arr, casting="unsafe")
    else:
        arr[...] = (arr.astype(np.float64) * factor).astype(arr.dtype)


def finish_average(arr: np.ndarray, size: int) -> None:
    """Turn a sum over ``size`` ranks into the average (integers truncate toward zero)."""
    scale_in_place(arr, 1.0 / size)


def finish_reduction(arr: np.ndarray, op: ReduceOp, postscale: float, size: int) -> None:
    """Turn a reduction over ``size`` ranks into the result: Average's division, then
    ``postscale``.

    Floating-point types scale once by ``postscale / size`` (one rounding, as Horovod
    does); integers divide first, truncating, then scale (see ``scale_in_place``).
    """
    if op == ReduceOp.Average:
        if is_floating(arr.dtype):
            postscale = postscale / size
        else:
            finish_average(arr, size)
    scale_in_place(arr, postscale)


def reduce_rows(rows: Sequence[np.ndarray], op: ReduceOp, postscale: float,
                reuse_first: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """Every rank's flat tensor combined in rank order, then finished (Average's division,
    ``postscale``): the arithmetic of every reduction done in one place (rank 0's eager
    result, the MPI response cache, two ranks deciding alone), so each gives the same bits.

    Args:
        rows: One flat array per rank, in rank order.
        reuse_first: ``rows[0]`` is the caller's scratch and may hold the result;
            otherwise the result is a new array (``rows[0]`` may be a caller's input).
        out: Where to write the result instead (flat, of the rows' size and dtype). It
            may be ``rows[0]`` or ``rows[1]`` itself: both are read before it is written.
    """
    if out is None:
        out = rows[0] if reuse_first else rows[0].copy()
        rest = rows[1:]
    elif len(rows) > 1:
        reduce_into(out, rows[1], op, base=rows[0])
        rest = rows[2:]
    else:
        np.copyto(out, rows[0])
        rest = []
    for row in rest:
        reduce_into(out, row, op)
    finish_reduction(out, op, postscale, len(rows))
    return out


def plain_reduction(dtype: np.dtype, op: ReduceOp, postscale: float,
                    size: int) -> tuple[np.ufunc, float | None] | None:
    """What ``reduce_rows`` does with ``size`` rows of ``dtype`` when that is one ufunc a
    row and at most one scaling: ``(ufunc, factor or None)``, so a caller that reduces
    the same kind of tensor again and again (the express path) can call numpy directly.

    None where ``reduce_rows`` does more: float16/bfloat16 (computed in float32),
    integers and bool that are scaled or averaged (truncated in float64), Adasum.
    """
    ufunc = _UFUNCS.get(op)
    if ufunc is None or dtype in _HALF:
        return None
    if dtype in _FLOATING:
        factor = postscale / size if op == ReduceOp.Average else postscale
        return ufunc, (None if factor == 1.0 else factor)
    if op == ReduceOp.Average or postscale != 1.0:
        return None
    return ufunc, None


def _scale_half(arr: np.ndarray, factor: float) -> None:
    f32 = np.float32(factor)
    flat = _flat(arr, arr.size)
    if flat is None:
        arr[...] = (arr.astype(np.float32) * f32).astype(arr.dtype)
        return
    kernels = _half_kernels
    if kernels is not None and kernels.scale(flat, factor):
        return
    buf = _scratch_f32()[0]
    for start in range(0, flat.size, HALF_CHUNK):
        stop = min(start + HALF_CHUNK, flat.size)
        a32 = buf[: stop - start]
        np.copyto(a32, flat[start:stop], casting="unsafe")
        np.multiply(a32, f32, out=a32)
        np.copyto(flat[start:stop], a32, casting="unsafe")
