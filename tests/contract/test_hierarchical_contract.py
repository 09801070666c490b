"""Hierarchical all-reduce (2 and 3 ranks per "host", over real TCP + shared memory)
against the communicator contract, and the rule deciding where it applies."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer
from hvd_spark.collectives.tcp import hierarchical
from hvd_spark.collectives.tcp.hierarchical import HierarchicalCommunicator, host_grid
from hvd_spark.collectives.tcp.shm import ShmLink
from tests.contract.communicator_contract import CommunicatorContract, run_parallel
from tests.contract.test_tcp_contract import make_tcp


def _grid(local_sizes: list[int]) -> list[tuple[int, int, int, int]]:
    """(local_rank, local_size, cross_rank, cross_size) per rank, as the launchers assign."""
    out = []
    for host, local_size in enumerate(local_sizes):
        for local in range(local_size):
            cross = sum(1 for n in local_sizes if n > local)
            cross_rank = sum(1 for n in local_sizes[:host] if n > local)
            out.append((local, local_size, cross_rank, cross))
    return out


def make_hierarchical(local_sizes: list[int]) -> list:
    grid = _grid(local_sizes)
    flats = make_tcp(len(grid), use_shm=True)
    found = run_parallel(flats, lambda c: host_grid(c, *grid[c.rank]))
    return flats, found


class TestHierarchicalTwoPerHost(CommunicatorContract):
    size = 6

    def make(self, size):
        flats, found = make_hierarchical([2, 2, 2])
        assert found == [(2, 3)] * 6
        return [HierarchicalCommunicator(c, 2, 3) for c in flats]


class TestHierarchicalThreePerHost(CommunicatorContract):
    size = 6

    def make(self, size):
        flats, found = make_hierarchical([3, 3])
        assert found == [(3, 2)] * 6
        run_parallel(flats, lambda c: hierarchical.share_memory_on_wrap(c, 3, "contract"))
        # Every link of each host's ring (0-1-2-0, 3-4-5-3) is shared memory (the wrap
        # 0-2 and 3-5 too, which are no neighbours on the flat ring).
        for c in flats:
            base = c.rank - c.rank % 3
            local = {p for p in range(base, base + 3) if p != c.rank}
            assert local <= set(c.shm_peers)
            assert all(isinstance(c.links[p], ShmLink) for p in local)
        return [HierarchicalCommunicator(c, 3, 2) for c in flats]


def test_uneven_hosts_keep_the_flat_ring_on_every_rank():
    flats, found = make_hierarchical([2, 1, 2])
    try:
        assert found == [None] * 5  # every rank takes the same decision
    finally:
        for c in flats:
            c.close()


def test_the_cross_rings_carry_one_slice_each():
    flats, _ = make_hierarchical([2, 2])
    comms = [HierarchicalCommunicator(c, 2, 2) for c in flats]
    try:
        assert [c.cross.size for c in comms] == [2] * 4
        # Rank 0's cross ring is {0, 2}; rank 1's is {1, 3}: one per local rank.
        assert comms[0].cross.links[1] is flats[0].links[2]
        assert comms[1].cross.links[1] is flats[1].links[3]

        def body(c):
            a = np.arange(1001, dtype=np.float64) + c.rank
            c.allreduce(SegmentedBuffer([a]), ops.Average)
            return a

        for out in run_parallel(comms, body):
            np.testing.assert_allclose(out, 4 * np.arange(1001) + 6)  # summed; scaled later
    finally:
        for c in comms:
            c.close()


class TestHierarchicalPipelined(CommunicatorContract):
    """Blocks of 4 KB: every all-reduce above goes through the overlapped block pipeline."""

    size = 4

    @pytest.fixture(autouse=True)
    def _small_blocks(self, monkeypatch):
        monkeypatch.setattr(hierarchical, "PIPELINE_BLOCK_BYTES", 4096)

    def make(self, size):
        flats, found = make_hierarchical([2, 2])
        assert found == [(2, 2)] * 4
        return [HierarchicalCommunicator(c, 2, 2) for c in flats]


def test_a_large_buffer_is_pipelined_and_exact():
    flats, _ = make_hierarchical([2, 2])
    comms = [HierarchicalCommunicator(c, 2, 2) for c in flats]
    n = 3 * hierarchical.PIPELINE_BLOCK_BYTES // 4 + 12_345  # four blocks, the last short
    try:
        def body(c):
            pieces = [np.full(1000, c.rank + 1.0, np.float32),
                      (np.arange(n - 1000) % 1000).astype(np.float32) * (c.rank + 1)]
            c.allreduce(SegmentedBuffer(pieces), ops.Sum)
            return pieces

        for head, tail in run_parallel(comms, body):
            assert (head == 10.0).all()
            np.testing.assert_array_equal(tail, (np.arange(n - 1000) % 1000) * 10.0)
    finally:
        for c in comms:
            c.close()
