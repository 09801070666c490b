"""One contract every Communicator backend must pass (TCP now; MPI and NCCL reuse it).

A subclass provides ``make(size)`` returning ``size`` connected communicators,
one per rank, usable from one thread each.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer, even_counts
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.errors import BackendUnavailableError, CollectiveError
from tests.threads import run_on_threads


def run_parallel(comms: list[Communicator], fn) -> list:
    """Run ``fn(comm)`` on every communicator in its own thread; re-raise errors."""
    return run_on_threads(comms, fn)


class CommunicatorContract:
    """Mixin of contract tests; subclasses define ``make``."""

    size = 3

    def make(self, size: int) -> list[Communicator]:
        raise NotImplementedError

    @pytest.fixture
    def comms(self):
        comms = self.make(self.size)
        yield comms
        for c in comms:
            c.close()

    def test_ranks_are_distinct(self, comms):
        assert sorted(c.rank for c in comms) == list(range(self.size))
        assert {c.size for c in comms} == {self.size}

    @pytest.mark.parametrize("n", [0, 1, 7, 1000, 300_001])
    def test_allreduce_sum_large_and_small(self, comms, n):
        def body(c):
            a = np.arange(n, dtype=np.float32) * (c.rank + 1)
            c.allreduce(SegmentedBuffer([a]), ops.Sum)
            return a

        total = sum(range(1, self.size + 1))
        for out in run_parallel(comms, body):
            np.testing.assert_allclose(out, np.arange(n, dtype=np.float32) * total, rtol=1e-6)

    @pytest.mark.parametrize("op", [ops.Min, ops.Max, ops.Product])
    def test_allreduce_ops_on_pieces(self, comms, op):
        def body(c):
            pieces = [np.full(5, c.rank + 2, np.int32), np.full(70_000, c.rank + 2, np.int32)]
            c.allreduce(SegmentedBuffer(pieces), op)
            return pieces

        values = [r + 2 for r in range(self.size)]
        want = {ops.Min: min(values), ops.Max: max(values), ops.Product: int(np.prod(values))}[op]
        for pieces in run_parallel(comms, body):
            for p in pieces:
                assert (p == want).all()

    @pytest.mark.parametrize("n", [7, 300_001])
    def test_allreduce_out_of_place_reads_the_inputs_and_leaves_them(self, comms, n):
        """Backends that read a ``source`` write the reduction into uninitialised output
        pieces and leave the inputs as they were (the others get the inputs copied in
        first, as ``operations.run_allreduce`` does)."""

        def body(c):
            inputs = [np.arange(n, dtype=np.float64) * (c.rank + 1), np.full(70_000, c.rank + 1.0)]
            kept = [a.copy() for a in inputs]
            outputs = [np.full(a.size, np.nan) for a in inputs]
            if c.reads_source:
                c.allreduce(SegmentedBuffer(outputs), ops.Sum, source=SegmentedBuffer(inputs))
            else:
                for out, a in zip(outputs, inputs):
                    out[...] = a
                c.allreduce(SegmentedBuffer(outputs), ops.Sum)
            return outputs, all((a == b).all() for a, b in zip(inputs, kept))

        total = sum(range(1, self.size + 1))
        for (big, small), kept in run_parallel(comms, body):
            assert kept, "the inputs changed"
            np.testing.assert_array_equal(big, np.arange(n, dtype=np.float64) * total)
            np.testing.assert_array_equal(small, np.full(70_000, float(total)))

    @pytest.mark.parametrize("n", [1, 7, 300_001])
    def test_allreduce_finish_runs_once_per_element(self, comms, n):
        """Backends that take ``finish=`` finish every element once, on one rank, and
        every rank receives the finished bits; the others finish nothing."""
        calls = [0] * self.size

        def body(c):
            pieces = [np.arange(n, dtype=np.float32) * (c.rank + 1), np.ones(5, np.float32)]

            def finish(views):
                for view in views:
                    calls[c.rank] += view.size
                    view *= np.float32(0.5)

            if c.finishes_segments:
                c.allreduce(SegmentedBuffer(pieces), ops.Sum, finish=finish)
            else:
                c.allreduce(SegmentedBuffer(pieces), ops.Sum)
                finish([p for p in pieces])
            return pieces

        total = sum(range(1, self.size + 1))
        outs = run_parallel(comms, body)
        if comms[0].finishes_segments:
            assert sum(calls) == n + 5
        for big, small in outs:
            np.testing.assert_allclose(big, np.arange(n, dtype=np.float32) * total * 0.5,
                                       rtol=1e-6)
            assert (small == self.size * 0.5).all()
            assert big.tobytes() == outs[0][0].tobytes()

    def test_chunk_size_changes_only_where_declared(self, comms):
        """``tunes_chunks``: the ranks switch their chunk between operations and the
        results stay exact (a chunk the buffers cannot take is refused); without it,
        ``set_chunk_bytes`` refuses (the autotuner then leaves the chunk alone)."""
        if not comms[0].tunes_chunks:
            with pytest.raises(BackendUnavailableError, match="no chunk size"):
                comms[0].set_chunk_bytes(8192)
            return
        with pytest.raises(CollectiveError, match="at least 4096"):
            comms[0].set_chunk_bytes(100)

        def body(c):
            c.set_chunk_bytes(8192)
            a = np.arange(50_000, dtype=np.float32) * (c.rank + 1)
            c.allreduce(SegmentedBuffer([a]), ops.Sum)
            return a

        total = sum(range(1, self.size + 1))
        for out in run_parallel(comms, body):
            np.testing.assert_array_equal(out, np.arange(50_000, dtype=np.float32) * total)

    def test_an_express_lane_joins_two_ranks_only(self, comms):
        """A declared express lane has a free buffer for a small tensor at the start."""
        for c in comms:
            if c.express_lane is not None:
                assert c.size == 2 and c.express_lane.can_post(64)

    def test_reducescatter_counts(self, comms):
        counts = even_counts(11, self.size)

        def body(c):
            a = np.ones(11) * (c.rank + 1)
            c.reducescatter(SegmentedBuffer([a]), ops.Sum, counts)
            start = sum(counts[: c.rank])
            return a[start : start + counts[c.rank]]

        total = sum(range(1, self.size + 1))
        for rank, out in enumerate(run_parallel(comms, body)):
            np.testing.assert_array_equal(out, np.full(counts[rank], float(total)))

    def test_allgather_variable_counts(self, comms):
        counts = [3 * r + 1 for r in range(self.size)]

        def body(c):
            buf = np.zeros(sum(counts), np.int64)
            start = sum(counts[: c.rank])
            buf[start : start + counts[c.rank]] = c.rank
            c.allgather(SegmentedBuffer([buf]), counts)
            return buf

        want = np.repeat(np.arange(self.size), counts)
        for out in run_parallel(comms, body):
            np.testing.assert_array_equal(out, want)

    def test_broadcast_from_every_root(self, comms):
        for root in range(self.size):
            def body(c, root=root):
                a = np.full(200_000, c.rank, np.float64)
                c.broadcast(SegmentedBuffer([a]), root)
                return a

            for out in run_parallel(comms, body):
                assert (out == root).all()

    def test_alltoall(self, comms):
        n = self.size

        def body(c):
            send_counts = [d + 1 for d in range(n)]
            send = np.concatenate([np.full(k, 10 * c.rank + d) for d, k in enumerate(send_counts)])
            recv_counts = [c.rank + 1] * n
            recv = np.empty(sum(recv_counts), send.dtype)
            c.alltoall(send, send_counts, recv, recv_counts)
            return recv

        for rank, out in enumerate(run_parallel(comms, body)):
            want = np.concatenate([np.full(rank + 1, 10 * s + rank) for s in range(n)])
            np.testing.assert_array_equal(out, want)

    def test_bf16_and_bool(self, comms):
        def body(c):
            a = np.full(1000, 1.5, ops.BFLOAT16)
            b = np.array([c.rank == 0, True, False])
            c.allreduce(SegmentedBuffer([a]), ops.Sum)
            c.allreduce(SegmentedBuffer([b]), ops.Max)
            return a, b

        for a, b in run_parallel(comms, body):
            assert a.dtype == ops.BFLOAT16 and float(a[0]) == 1.5 * self.size
            assert b.tolist() == [True, True, False]

    def test_peer_closing_fails_others_quickly(self, comms):
        victim = comms[-1]
        survivors = comms[:-1]
        threading.Timer(0.3, victim.close).start()
        start = time.monotonic()

        def body(c):
            a = np.ones(1 << 16, np.float32)
            with pytest.raises(CollectiveError):
                try:
                    for _ in range(100_000):
                        c.allreduce(SegmentedBuffer([a]), ops.Sum)
                finally:
                    c.close()  # as the engine does: a failed rank closes, so the failure cascades
            return time.monotonic() - start

        for elapsed in run_parallel(survivors, body):
            assert elapsed < 10
