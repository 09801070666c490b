"""One negotiation round over MPI: every rank's requests to rank 0, its answer to all.

As Horovod's MPI controller: a gather of what each rank asks for, then a broadcast of
what to run. Each goes through a fixed-size slot (one non-blocking collective when the
message fits, the common case); a longer message follows in a second collective whose
size every participant knows from the slot's header.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from hvd_spark.collectives.mpi.waiting import AbortChannel, wait

SLOT_BYTES = 4096
_HEADER = struct.Struct("<q")
_ROOM = SLOT_BYTES - _HEADER.size
# The broadcast header's value asking every rank for the rest of its long message.
_SEND_REST = -1


class Negotiation:
    """The gather/broadcast pair of a negotiation cycle on a dedicated communicator.

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
        self._slots = np.zeros(SLOT_BYTES * self.size, np.uint8) if self.rank == 0 else None

    def _wait(self, request: Any, what: str) -> None:
        wait(request, time.monotonic() + self.timeout, self.abort, f"negotiation ({what})")

    @staticmethod
    def _fill(slot: np.ndarray, header: int, payload: bytes) -> None:
        slot[: _HEADER.size] = np.frombuffer(_HEADER.pack(header), np.uint8)
        head = payload[:_ROOM]
        slot[_HEADER.size : _HEADER.size + len(head)] = np.frombuffer(head, np.uint8)

    @staticmethod
    def _read(slot: np.ndarray) -> tuple[int, bytes]:
        (header,) = _HEADER.unpack(slot[: _HEADER.size].tobytes())
        size = max(0, min(header, _ROOM))
        return header, slot[_HEADER.size : _HEADER.size + size].tobytes()

    def round(self, payload: bytes, decide: Callable[[list[bytes]], bytes]) -> bytes:
        """Send ``payload`` to rank 0, which answers with ``decide(every rank's payload)``.

        Returns:
            Rank 0's answer, on every rank (``decide`` runs on rank 0 only).
        """
        self._fill(self._slot, len(payload), payload)
        self._wait(self.comm.Igather(self._slot, self._slots, root=0), "gather")
        parts: list[bytes] = []
        rest_counts = [0] * self.size
        if self.rank == 0:
            for r in range(self.size):
                length, head = self._read(self._slots[r * SLOT_BYTES : (r + 1) * SLOT_BYTES])
                parts.append(head)
                rest_counts[r] = max(0, length - _ROOM)
            if not any(rest_counts):
                return self._broadcast(decide(parts))
            # Some rank's message is longer than its slot: ask everyone for the rest.
            self._fill(self._slot, _SEND_REST, b"")
        answer = self._broadcast(None, asking=self.rank == 0)
        if answer is not None:
            return answer
        mine = np.frombuffer(payload[_ROOM:], np.uint8)
        if self.rank != 0:
            self._wait(self.comm.Igatherv([mine, MPI.BYTE], None, root=0), "gather: rest")
            return self._broadcast(None)
        rest = np.empty(sum(rest_counts), np.uint8)
        displs = np.cumsum([0, *rest_counts[:-1]]).tolist()
        self._wait(self.comm.Igatherv([mine, MPI.BYTE], [rest, (rest_counts, displs), MPI.BYTE],
                                      root=0), "gather: rest")
        for r, (start, count) in enumerate(zip(displs, rest_counts)):
            parts[r] += rest[start : start + count].tobytes()
        return self._broadcast(decide(parts))

    def _broadcast(self, payload: bytes | None, asking: bool = False) -> bytes | None:
        """Rank 0's ``payload`` on every rank; None when rank 0 asked for the rest instead.

        With ``asking``, rank 0's slot already holds the request for the rest.
        """
        if self.rank == 0 and not asking:
            self._fill(self._slot, len(payload or b""), payload or b"")
        self._wait(self.comm.Ibcast(self._slot, root=0), "broadcast")
        length, head = self._read(self._slot)
        if length == _SEND_REST:
            return None
        if length <= _ROOM:
            return head
        data = payload or b""
        rest = (np.frombuffer(data[_ROOM:], np.uint8).copy() if self.rank == 0
                else np.empty(length - _ROOM, np.uint8))
        self._wait(self.comm.Ibcast(rest, root=0), "broadcast: rest")
        return head + rest.tobytes()
