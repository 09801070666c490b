"""One negotiation round over MPI: every rank's requests to every rank, rank 0's answer to all.

A round starts with one allgather of fixed-size slots, so every rank sees what every
rank asks for. When the ranks ask for operations they already agreed on (the engine's
response cache), each rank decides alone, the same way, and the round ends there: one
collective. Otherwise rank 0 decides and broadcasts its answer, as Horovod's MPI
controller does. A message longer than its slot sends its rest to rank 0 in a second
collective whose sizes every rank knows from the slots' headers.

The slot is sized under Open MPI's shared-memory eager limit (4 KB including its own
header): a 4096-byte slot took the rendezvous protocol, 2-3x slower (gather+broadcast
15 us against 7.5 us for 4000 bytes, 2 ranks on one host).
"""

from __future__ import annotations

import struct
import time
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from hvd_spark.collectives.mpi.waiting import AbortChannel, wait

SLOT_BYTES = 3968
# Message length, then flags (the engine's; rank 0 says whether its coordinator is idle).
_HEADER = struct.Struct("<qq")
ROOM = SLOT_BYTES - _HEADER.size


class Shared(NamedTuple):
    """What one round's allgather brought.

    Attributes:
        parts: Every rank's message, in rank order. On ranks other than 0 a message
            longer than its slot is cut to its slot (see ``whole``).
        flags: Every rank's flags, in rank order.
        whole: Every message fit its slot: every rank holds all of them in full.
    """

    parts: list[bytes]
    flags: list[int]
    whole: bool


class Negotiation:
    """The allgather (and, when rank 0 decides, broadcast) of a cycle on a dedicated
    communicator.

    Args:
        comm: An MPI communicator of all ranks, used for nothing else.
        abort: The job's abort channel (a peer that gives up ends our waits).
        timeout: Seconds a round may wait for the slowest rank.
    """

    def __init__(self, comm: Any, abort: AbortChannel, timeout: float) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.abort = abort
        self.timeout = timeout
        self._slot = np.zeros(SLOT_BYTES, np.uint8)
        self._slots = np.zeros(SLOT_BYTES * self.size, np.uint8)
        # A persistent allgather (MPI 4): starting it costs about 1 us where an
        # Iallgather builds its schedule anew each round (5 us here).
        self._gather = None
        try:
            self._gather = comm.Allgather_init(self._slot, self._slots)
        except (AttributeError, NotImplementedError, MPI.Exception):
            pass  # an MPI before 4: a new Iallgather each round

    def _wait(self, request: Any, what: str) -> None:
        wait(request, time.monotonic() + self.timeout, self.abort, f"negotiation ({what})")

    @staticmethod
    def _fill(slot: np.ndarray, length: int, flags: int, payload: bytes) -> None:
        head = payload[:ROOM]
        _HEADER.pack_into(slot, 0, length, flags)  # C-level copies, no intermediate arrays
        memoryview(slot)[_HEADER.size : _HEADER.size + len(head)] = head

    @staticmethod
    def _read(slot: np.ndarray) -> tuple[int, int, bytes]:
        length, flags = _HEADER.unpack_from(slot)
        size = max(0, min(length, ROOM))
        return length, flags, bytes(memoryview(slot)[_HEADER.size : _HEADER.size + size])

    def share(self, payload: bytes, flags: int = 0) -> Shared:
        """Send ``payload`` and ``flags`` to every rank (the rest of a long one to rank 0).

        Returns:
            Every rank's message and flags.
        """
        self.exchange(payload, flags)
        return self.collect(payload)

    def exchange(self, payload: bytes, flags: int = 0) -> None:
        """The round's allgather of slots: every rank's slot lies in ``_slots`` after it.
        ``collect`` (same ``payload``) must follow before the next round, unless
        ``alike`` found every message whole."""
        self._fill(self._slot, len(payload), flags, payload)
        gather = self._gather
        if gather is None:
            gather = self.comm.Iallgather(self._slot, self._slots)
        else:
            gather.Start()
        self._wait(gather, "allgather")

    def alike(self, head: bytes, length: int) -> int | None:
        """After ``exchange``: rank 0's flags when every rank sent a message of
        ``length`` bytes (all within its slot) that starts with ``head``; else None."""
        if length > ROOM:
            return None
        slots, size, skip = self._slots, len(head), _HEADER.size
        flags0 = None
        for start in range(0, SLOT_BYTES * self.size, SLOT_BYTES):
            got, flags = _HEADER.unpack_from(slots, start)
            if got != length or slots[start + skip : start + skip + size].tobytes() != head:
                return None
            if flags0 is None:
                flags0 = flags
        return flags0

    def rows(self, offset: int, dtype: np.dtype, count: int) -> list[np.ndarray]:
        """After ``exchange``: ``count`` items of ``dtype`` at ``offset`` in each rank's
        message, as views of the slots (valid until the next round)."""
        base = _HEADER.size + offset
        return [np.frombuffer(self._slots, dtype, count, base + r * SLOT_BYTES)
                for r in range(self.size)]

    def collect(self, payload: bytes) -> Shared:
        """After ``exchange`` of ``payload``: every rank's message and flags, the rest of
        long ones gathered on rank 0 (a collective when some message is long)."""
        parts: list[bytes] = []
        all_flags: list[int] = []
        rest_counts = [0] * self.size
        for r in range(self.size):
            length, got_flags, head = self._read(self._slots[r * SLOT_BYTES : (r + 1) * SLOT_BYTES])
            parts.append(head)
            all_flags.append(got_flags)
            rest_counts[r] = max(0, length - ROOM)
        if not any(rest_counts):
            return Shared(parts, all_flags, True)
        # Some rank's message is longer than its slot: every rank knows, from the headers.
        mine = np.frombuffer(payload[ROOM:], np.uint8)
        if self.rank != 0:
            self._wait(self.comm.Igatherv([mine, MPI.BYTE], None, root=0), "gather: rest")
            return Shared(parts, all_flags, False)
        rest = np.empty(sum(rest_counts), np.uint8)
        displs = np.cumsum([0, *rest_counts[:-1]]).tolist()
        self._wait(self.comm.Igatherv([mine, MPI.BYTE], [rest, (rest_counts, displs), MPI.BYTE],
                                      root=0), "gather: rest")
        for r, (start, count) in enumerate(zip(displs, rest_counts)):
            parts[r] += rest[start : start + count].tobytes()
        return Shared(parts, all_flags, False)

    def answer(self, payload: bytes | None) -> bytes:
        """Rank 0's ``payload`` on every rank (the others pass None)."""
        data = payload or b""
        if self.rank == 0:
            self._fill(self._slot, len(data), 0, data)
        self._wait(self.comm.Ibcast(self._slot, root=0), "broadcast")
        length, _, head = self._read(self._slot)
        if length <= ROOM:
            return head
        rest = (np.frombuffer(data[ROOM:], np.uint8).copy() if self.rank == 0
                else np.empty(length - ROOM, np.uint8))
        self._wait(self.comm.Ibcast(rest, root=0), "broadcast: rest")
        return head + rest.tobytes()
