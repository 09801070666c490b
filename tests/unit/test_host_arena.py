"""The host arena's own promises, beyond the communicator contract (which runs its
allreduces in ``tests/contract/test_tcp_contract.py``): every rank agrees on having one,
a late rank is waited for with a deadline, and the sockets it watches are never read."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer
from hvd_spark.collectives.tcp.arena import HostArena, negotiate_arena
from hvd_spark.collectives.tcp.shm import remove_segments
from hvd_spark.errors import CollectiveTimeoutError
from tests.contract.test_tcp_contract import form_meshes
from tests.threads import run_on_threads

_TAG = "arenatest"


def _meshes(size: int, timeout: float = 30) -> list:
    meshes = form_meshes(["host"] * size)
    for mesh in meshes.values():
        for sock in mesh.data.values():
            sock.settimeout(timeout)  # the collective deadline the arena keeps
    return [meshes[r] for r in range(size)]


def _close(meshes: list, arenas: list | None = None) -> None:
    for arena in arenas or []:
        if arena is not None:
            arena.close()
    for mesh in meshes:
        for sock in [*mesh.data.values(), *mesh.control.values()]:
            sock.close()


def _arenas(meshes: list, capacity: int = 4096) -> list[HostArena]:
    size = len(meshes)
    arenas = run_on_threads(list(range(size)), lambda r: negotiate_arena(
        r, size, meshes[r].data, capacity, tag=_TAG))
    assert all(a is not None for a in arenas)
    return arenas


@pytest.mark.parametrize("case", ["one rank does not offer", "capacities differ"])
def test_every_rank_gets_none_when_one_cannot_take_part(case):
    meshes = _meshes(3)
    try:
        def negotiate(rank):
            capacity = 8192 if case == "capacities differ" and rank == 2 else 4096
            offer = not (case == "one rank does not offer" and rank == 1)
            return negotiate_arena(rank, 3, meshes[rank].data, capacity, tag=_TAG, offer=offer)

        assert run_on_threads(list(range(3)), negotiate) == [None, None, None]
        # The sockets are left in step: a second negotiation that all offer agrees, and
        # no segment file is left behind either time.
        _close([], _arenas(meshes))
        assert remove_segments(_TAG) == 0
    finally:
        _close(meshes)


def test_a_rank_that_never_arrives_times_out_by_name():
    meshes = _meshes(3, timeout=1.0)  # the sockets' timeout is the collective deadline
    arenas = _arenas(meshes)
    try:
        def body(arena):
            if arena.rank == 2:
                return None  # never calls the allreduce: its socket stays open
            start = time.monotonic()
            with pytest.raises(CollectiveTimeoutError, match=r"rank\(s\) 2\b"):
                arena.allreduce(SegmentedBuffer([np.ones(100, np.float32)]), ops.Sum)
            return time.monotonic() - start

        waited = [w for w in run_on_threads(arenas, body) if w is not None]
        assert len(waited) == 2 and all(0.9 < w < 5 for w in waited), waited
    finally:
        _close(meshes, arenas)


def test_bytes_a_rank_ahead_sends_stay_on_the_socket():
    """A rank already past the allreduce may send the next operation's bytes; the ranks
    still waiting look at its socket (for a close) but must not consume them."""
    meshes = _meshes(2)
    arenas = _arenas(meshes)
    try:
        # Rank 0 "is ahead": its next operation's bytes are on the socket first.
        meshes[0].data[1].sendall(b"next-op")

        def body(arena):
            a = np.full(3000, arena.rank + 1.0)  # 24 KB: six pieces, through both areas
            if arena.rank == 0:
                time.sleep(0.05)  # rank 1 waits (naps, looks at the socket) meanwhile
            arena.allreduce(SegmentedBuffer([a]), ops.Sum)
            return a

        for out in run_on_threads(arenas, body):
            assert (out == 3.0).all()
        assert meshes[1].data[0].recv(16) == b"next-op"
    finally:
        _close(meshes, arenas)
