"""What the allreduce benchmarks share: sizes, the timing loop and bus bandwidth.

``allreduce`` (host buffers), ``cuda_allreduce`` (``--device cuda``) and
``multihost_allreduce`` (``--hosts``) all import from here, never from each other.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

#: The host benchmark's sizes; the CUDA and multi-host forms pick their own when unchanged.
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'64M' -> 67108864."""
    text = text.strip().upper().rstrip("B")
    unit = _UNITS.get(text[-1:], 1)
    return int(float(text[:-1] if unit > 1 else text) * unit)


def human_size(nbytes: int) -> str:
    """67108864 -> '64M' (exact multiples only; otherwise the plain number)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def iterations(nbytes: int, budget_bytes: float) -> int:
    """Calls to time for one size: about ``budget_bytes`` in all, between 5 and 200."""
    return int(min(200, max(5, budget_bytes // max(nbytes, 1))))


def time_loop(fn: Callable[[], object], iters: int, barrier: Callable[[], object],
              reduce_max: Callable[[float], float]) -> float:
    """Seconds per call of ``fn``, the slowest rank's, after warm-up."""
    for _ in range(2):
        fn()
    # A full collection now, not inside the timing: once torch is imported one takes
    # about 90 ms here, and where it fell decided a 1 MB figure (a 2-3x swing).
    gc.collect()
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return reduce_max((time.perf_counter() - start) / iters)


def busbw(nbytes: int, seconds: float, n: int) -> float:
    """nccl-tests' bus bandwidth in GB/s: 2(N-1)/N x bytes / time (comparable across N)."""
    return 2 * (n - 1) / n * nbytes / seconds / 1e9 if n > 1 else nbytes / seconds / 1e9
