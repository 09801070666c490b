"""In-memory Links for testing the ring algorithms as pure logic, one thread per rank."""

from __future__ import annotations

import queue

import numpy as np

from hvd_spark.collectives import ops
from hvd_spark.collectives.tcp.links import Link
from tests.threads import run_on_threads


class MemoryLink(Link):
    """One direction pair between two ranks, backed by two queues (test double)."""

    def __init__(self, peer: int, outbox: queue.Queue, inbox: queue.Queue) -> None:
        self.peer = peer
        self._outbox, self._inbox = outbox, inbox

    def send(self, views):
        self._outbox.put(b"".join(v.view(np.uint8).tobytes() for v in views))

    def wait_sent(self):
        pass

    def _take(self, views) -> bytes:
        data = self._inbox.get(timeout=10)
        assert len(data) == sum(v.nbytes for v in views), "ring sent a chunk of the wrong size"
        return data

    def recv_into(self, views):
        data, offset = self._take(views), 0
        for v in views:
            v.view(np.uint8)[...] = np.frombuffer(data, np.uint8, v.nbytes, offset)
            offset += v.nbytes

    def recv_reduce(self, views, op, bases=None):
        data, offset = self._take(views), 0
        for i, v in enumerate(views):
            ops.reduce_into(v, np.frombuffer(data, v.dtype, v.size, offset), op,
                            None if bases is None else bases[i])
            offset += v.nbytes

    def close(self):
        pass


def full_mesh(size: int) -> list[dict[int, MemoryLink]]:
    """links[r][p] is rank r's link to rank p."""
    queues = {(a, b): queue.Queue() for a in range(size) for b in range(size) if a != b}
    return [
        {p: MemoryLink(p, queues[(r, p)], queues[(p, r)]) for p in range(size) if p != r}
        for r in range(size)
    ]


def run_ranks(size: int, fn) -> list:
    """Run ``fn(rank, links)`` on ``size`` threads; re-raise the first error."""
    mesh = full_mesh(size)
    return run_on_threads(range(size), lambda rank: fn(rank, mesh[rank]), timeout=60)
