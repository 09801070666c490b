"""The express lane: with two ranks on one host, a synchronous allreduce's tensor crosses
through shared memory instead of the control socket.

The express path (``ExpressMixin.express_allreduce``) sends each rank's request to the
other with its tensor along and both reduce the two (see ``pairing``). Inline, the tensor
is pickled into the control socket: copied into the kernel and out again, plus a wake-up
per socket buffer, which is most of a 64 KB-4 MB call's time. On the lane the sender
copies it once into one of two buffers of a segment the peer has mapped and sends the
request with the buffer's sequence number (``Request.lane``); the receiver reduces
straight out of the buffer, or copies it out when the request takes the usual path, and
counts it consumed in the sender's segment. A sender reuses a buffer only once the peer
has consumed what it held, which express's lock step all but guarantees with two
buffers; otherwise it does not take the lane, so it never waits.

Memory order: the bytes are written before the request that names them is sent, and a
socket's send and receive order them on every CPU. The consumed count is written after
the bytes are read and read before a buffer is written again; only x86-64 promises that
a store does not pass earlier loads without a fence numpy cannot issue, so the lane is
made only there (elsewhere tensors keep riding inline).
"""

from __future__ import annotations

import mmap
import platform
import socket

import numpy as np

from hvd_spark.collectives.messages import dtype_of
from hvd_spark.collectives.tcp.shm import negotiate_segments, unmap
from hvd_spark.errors import CollectiveError

# Where the consumed count lives in a segment (after the token negotiate_segments
# writes), and where the buffers start (page-aligned).
_CONSUMED_OFFSET = 64
_DATA_OFFSET = 4096
_BUFFERS = 2
#: Smaller tensors ride inline with their request (when they may): one copy fewer.
LANE_MIN_BYTES = 32 * 1024
_ORDERED_MACHINES = frozenset({"x86_64", "amd64", "i686", "i386"})


def lane_supported() -> bool:
    """Whether this CPU keeps the order the lane relies on (see the module docstring)."""
    return platform.machine().lower() in _ORDERED_MACHINES


class ExpressLane:
    """Two rings of two buffers between the two ranks of a job on one host.

    Args:
        out_map: The segment this rank writes tensors into (the peer counts there what
            it consumed).
        in_map: The segment the peer writes tensors into (this rank counts there).

    Each segment's size sets its buffers' (``capacity``: the largest tensor this rank
    sends; the peer's may differ, if its setting does).
    """

    def __init__(self, out_map: mmap.mmap, in_map: mmap.mmap) -> None:
        self.capacity = (len(out_map) - _DATA_OFFSET) // _BUFFERS
        self._in_capacity = (len(in_map) - _DATA_OFFSET) // _BUFFERS
        self._maps = [out_map, in_map]
        self._out = np.frombuffer(out_map, np.uint8)
        self._in = np.frombuffer(in_map, np.uint8)
        # Written by the peer, read here; written here, read by the peer (aligned 8-byte
        # stores: a reader sees the old count or the new, never a torn one).
        self._peer_consumed = self._out[_CONSUMED_OFFSET:_CONSUMED_OFFSET + 8].view(np.uint64)
        self._consumed = self._in[_CONSUMED_OFFSET:_CONSUMED_OFFSET + 8].view(np.uint64)
        #: Tensors this rank put on the lane.
        self.posted = 0
        self._viewed = 0  # the peer's tensors this rank has seen named (in order)

    @staticmethod
    def _buffer(base: np.ndarray, seq: int, capacity: int) -> np.ndarray:
        start = _DATA_OFFSET + (seq % _BUFFERS) * capacity
        return base[start:start + capacity]

    def can_post(self, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` fits and its buffer is free (the peer consumed
        what that buffer held)."""
        return (nbytes <= self.capacity
                and int(self._peer_consumed[0]) >= self.posted - (_BUFFERS - 1))

    def post(self, flat: np.ndarray) -> int:
        """Copy the 1-D contiguous ``flat`` into the next buffer (``can_post`` said it is
        free) and return its sequence number, for the request that names it."""
        seq = self.posted
        np.copyto(self._buffer(self._out, seq, self.capacity)[:flat.nbytes], flat.view(np.uint8))
        self.posted += 1
        return seq

    def view(self, seq: int, dtype: str, count: int) -> np.ndarray:
        """The peer's tensor ``seq`` in place (valid until ``release(seq)``).

        Raises:
            CollectiveError: ``seq`` is not the next the peer posted (a protocol error).
        """
        if seq != self._viewed:
            raise CollectiveError(f"express lane out of order: tensor {seq} arrived where "
                                  f"{self._viewed} was due (a protocol error; please report it)")
        dt = dtype_of(dtype)
        nbytes = count * dt.itemsize
        if nbytes > self._in_capacity:
            raise CollectiveError(f"express lane tensor {seq} of {nbytes} bytes exceeds the "
                                  f"{self._in_capacity}-byte buffers (a protocol error)")
        self._viewed += 1
        return self._buffer(self._in, seq, self._in_capacity)[:nbytes].view(dt)

    def release(self, seq: int) -> None:
        """Count the peer's tensor ``seq`` consumed: its buffer may be written again
        (tensors are released in the order they were posted)."""
        self._consumed[0] = seq + 1

    def close(self) -> None:
        """Unmap both segments (views still alive in a failing frame: GC unmaps)."""
        self._out = self._in = self._peer_consumed = self._consumed = None  # type: ignore[assignment]
        unmap(self._maps)
        self._maps = []


def negotiate_lane(sock: socket.socket, peer: int, capacity: int,
                   tag: str = "job") -> ExpressLane | None:
    """Set up the express lane with ``peer`` over its authenticated data socket.

    Both ranks of a two-rank job call this at the same point, whatever their settings:
    a rank whose ``capacity`` is 0 (lane off) offers no segment, and then neither gets a
    lane (None on both), as when no shared segment could be mapped.
    """
    maps = negotiate_segments(sock, peer, _DATA_OFFSET + _BUFFERS * capacity, tag,
                              offer=capacity > 0,
                              instead="synchronous allreduces go without the express lane")
    return None if maps is None else ExpressLane(*maps)
