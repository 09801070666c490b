"""A list of arrays seen as one flat array, so fused tensors need no fusion copy.

The ring algorithms address element ranges of a ``SegmentedBuffer``; each range
maps back to views of the caller's own arrays, which are reduced in place.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import math
import threading
import weakref
from collections.abc import Iterator, Sequence

import numpy as np


class SegmentedBuffer:
    """Several 1-D contiguous arrays of one dtype addressed as one virtual array.

    Args:
        pieces: 1-D C-contiguous arrays, all of the same dtype.
    """

    def __init__(self, pieces: Sequence[np.ndarray]) -> None:
        if not pieces:
            raise ValueError("a SegmentedBuffer needs at least one piece")
        self.dtype = pieces[0].dtype
        for piece in pieces:
            if piece.dtype != self.dtype or piece.ndim != 1 or not piece.flags.c_contiguous:
                raise ValueError("pieces must be 1-D contiguous arrays of one dtype")
        self.pieces = [p for p in pieces if p.size]
        self._starts = [0]
        for piece in self.pieces:
            self._starts.append(self._starts[-1] + piece.size)
        self.size = self._starts[-1]
        self.itemsize = self.dtype.itemsize

    @classmethod
    def of(cls, array: np.ndarray) -> SegmentedBuffer:
        """Wrap one contiguous array of any shape."""
        return cls([array.reshape(-1)])

    @property
    def nbytes(self) -> int:
        """Total bytes of all pieces."""
        return self.size * self.itemsize

    def views(self, start: int, stop: int) -> list[np.ndarray]:
        """Views of the caller's arrays covering elements ``[start, stop)``."""
        if start >= stop:
            return []
        out = []
        i = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            piece, base = self.pieces[i], self._starts[i]
            end = min(stop, base + piece.size)
            out.append(piece[start - base : end - base])
            start = end
            i += 1
        return out

    def chunks(self, start: int, stop: int, chunk_bytes: int) -> Iterator[list[np.ndarray]]:
        """Yield view lists for ``[start, stop)`` cut into chunks of at most ``chunk_bytes``."""
        step = max(1, chunk_bytes // self.itemsize)
        for lo in range(start, stop, step):
            yield self.views(lo, min(stop, lo + step))


ALIGN_BYTES = 64


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary.

    A framework binding may hand such a buffer on without a copy (some frameworks
    require this alignment of buffers they adopt through DLPack).
    """
    if not isinstance(dtype, np.dtype):
        dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN_BYTES, np.uint8)
    # The address through ctypes: ``raw.ctypes.data`` costs 1.4 us, this 0.4.
    start = -ctypes.addressof(ctypes.c_char.from_buffer(raw)) % ALIGN_BYTES
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class OutputPool:
    """Large output arrays whose memory is reused once the caller has dropped them.

    A fresh 64 MB array costs its page faults (the kernel zeroes every page on first
    touch) each time, which made an out-of-place allreduce about half as fast as an
    in-place one. Outputs of at least ``min_bytes`` are therefore carved from blocks
    this pool keeps: each array's buffer is a small ctypes object over the block, so
    the block comes back (through a ``weakref.finalize`` on that object) only when no
    array, view or framework tensor made from it is left alive.

    The default ``min_bytes`` is malloc's threshold for memory of its own: in a process
    whose threads allocate and free such sizes, glibc serves every allocation of
    128 KB or more from fresh pages of the kernel, each touched anew (an out-of-place
    allreduce of 256 KB spent more on those faults than on its reduction).

    Args:
        min_bytes: Smaller outputs come from ``aligned_empty`` (malloc reuses those).
        max_idle_bytes: Idle blocks kept beyond this are let go, oldest first.
    """

    def __init__(self, min_bytes: int = 128 << 10, max_idle_bytes: int = 512 << 20) -> None:
        # ``init()`` sets max_idle_bytes from HVD_SPARK_OUTPUT_POOL_BYTES.
        self.min_bytes = min_bytes
        self.max_idle_bytes = max_idle_bytes
        self._idle: collections.OrderedDict[int, list[np.ndarray]] = collections.OrderedDict()
        self._idle_bytes = 0
        # Finalizers run wherever the last reference dies (any thread, even inside
        # ``empty`` during a garbage collection): they only append here, never lock.
        self._returned: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        """Bytes held in idle blocks (after taking in the blocks returned so far)."""
        with self._lock:
            self._take_returned()
        return self._idle_bytes

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised, 64-byte aligned C-contiguous array (as ``aligned_empty``)."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes or self.max_idle_bytes <= 0:
            return aligned_empty(shape, dtype)
        key = -(-nbytes // 4096) * 4096  # page granularity: near sizes share blocks
        with self._lock:
            self._take_returned()
            blocks = self._idle.get(key)
            raw = blocks.pop() if blocks else None
            if raw is not None:
                self._idle_bytes -= key
                if not blocks:
                    del self._idle[key]
        if raw is None:
            raw = np.empty(key + ALIGN_BYTES, np.uint8)
        address = raw.ctypes.data + (-raw.ctypes.data) % ALIGN_BYTES
        owner = (ctypes.c_uint8 * nbytes).from_address(address)
        # Not at exit: the block is freed with the process anyway.
        weakref.finalize(owner, self._returned.append, (key, raw)).atexit = False
        return np.frombuffer(owner, dtype).reshape(shape)

    def _take_returned(self) -> None:
        while self._returned:
            key, raw = self._returned.popleft()
            self._idle.setdefault(key, []).append(raw)
            self._idle.move_to_end(key)
            self._idle_bytes += key
        while self._idle_bytes > self.max_idle_bytes and self._idle:
            key, blocks = next(iter(self._idle.items()))
            blocks.pop(0)
            self._idle_bytes -= key
            if not blocks:
                del self._idle[key]


#: The process's pool for collective outputs (see ``OutputPool``).
OUTPUTS = OutputPool()


def even_counts(total: int, parts: int) -> list[int]:
    """Split ``total`` into ``parts`` counts differing by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def offsets(counts: Sequence[int]) -> list[int]:
    """Exclusive prefix sums: where each count's range starts."""
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def nbytes_of(views: Sequence[np.ndarray]) -> int:
    """Total bytes of a view list."""
    return sum(v.nbytes for v in views)
