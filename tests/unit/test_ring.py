"""The ring algorithms as pure logic over in-memory links, against numpy references."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer, even_counts
from hvd_spark.collectives.tcp import ring
from tests.unit.memlinks import run_ranks

SIZES = [0, 1, 2, 6, 8, 13, 97, 10007]


def _data(rank: int, n: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(rank * 7919 + n)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, n).astype(bool)
    if ops.is_floating(np.dtype(dtype)):
        return rng.uniform(0.5, 1.5, n).astype(dtype)
    return rng.integers(1, 4, n).astype(dtype)


def _reference(arrays, op):
    fn = {ops.Sum: np.add, ops.Average: np.add, ops.Min: np.minimum, ops.Max: np.maximum,
          ops.Product: np.multiply}[op]
    out = arrays[0].copy()
    for a in arrays[1:]:
        out = fn(out, a).astype(out.dtype)
    return out


def _allreduce(size, n, dtype, op, chunk_bytes=64):
    inputs = [_data(r, n, dtype) for r in range(size)]

    def body(rank, links):
        buf = inputs[rank].copy()
        left = links.get((rank - 1) % size)
        right = links.get((rank + 1) % size)
        ring.allreduce(SegmentedBuffer([buf]), op, rank, size, left, right, chunk_bytes)
        return buf

    return inputs, run_ranks(size, body)


@pytest.mark.parametrize("size", range(1, 8))
@pytest.mark.parametrize("n", SIZES)
def test_allreduce_every_size(size, n):
    inputs, outputs = _allreduce(size, n, np.float64, ops.Sum)
    want = _reference(inputs, ops.Sum)
    for out in outputs:
        np.testing.assert_allclose(out, want, rtol=1e-12)
    # Every rank must hold bit-identical results: the ring reduces each element once.
    for out in outputs[1:]:
        assert out.tobytes() == outputs[0].tobytes()


@pytest.mark.parametrize("size", [size for size in (2, 3, 5)])
@pytest.mark.parametrize("n", [size - 1 for size in (2, 3, 5)] + [size + 1 for size in (2, 3, 5)])
def test_allreduce_around_world_size(size, n):
    inputs, outputs = _allreduce(size, n, np.int64, ops.Sum)
    for out in outputs:
        np.testing.assert_array_equal(out, _reference(inputs, ops.Sum))


@pytest.mark.parametrize("dtype", sorted(ops.SUPPORTED_DTYPES, key=str))
@pytest.mark.parametrize("op", [ops.Sum, ops.Min, ops.Max, ops.Product])
def test_allreduce_every_dtype_and_op(dtype, op):
    inputs, outputs = _allreduce(3, 37, dtype, op)
    want = _reference(inputs, op)
    tol = 1e-2 if np.dtype(dtype).itemsize <= 2 and ops.is_floating(np.dtype(dtype)) else 1e-6
    for out in outputs:
        assert out.dtype == np.dtype(dtype)
        np.testing.assert_allclose(out.astype(np.float64), want.astype(np.float64), rtol=tol)


def test_allreduce_segmented_buffer_spanning_pieces():
    size = 3
    shapes = [5, 1, 17, 0, 40]

    def body(rank, links):
        pieces = [np.full(n, rank + 1.0) for n in shapes]
        buf = SegmentedBuffer(pieces)
        ring.allreduce(buf, ops.Sum, rank, size, links[(rank - 1) % size],
                       links[(rank + 1) % size], 24)
        return pieces

    for pieces in run_ranks(size, body):
        for piece, n in zip(pieces, shapes):
            np.testing.assert_array_equal(piece, np.full(n, 6.0))


@pytest.mark.parametrize("size", range(1, 6))
@pytest.mark.parametrize("n", [0, 1, 7, 97, 1000])
def test_out_of_place_allreduce_reads_the_input_and_fills_every_element(size, n):
    """With source=, the output starts as garbage (NaN) and the input stays untouched."""
    inputs = [_data(r, n, np.float64) for r in range(size)]
    shapes = [n // 3, n - n // 3]

    def body(rank, links):
        src = inputs[rank].copy()
        src_pieces = [src[: shapes[0]], src[shapes[0]:]]
        out_pieces = [np.full(k, np.nan) for k in shapes]
        ring.allreduce(SegmentedBuffer(out_pieces), ops.Sum, rank, size,
                       links.get((rank - 1) % size), links.get((rank + 1) % size), 40,
                       source=SegmentedBuffer(src_pieces))
        assert src.tobytes() == inputs[rank].tobytes()
        return np.concatenate(out_pieces)

    outputs = run_ranks(size, body)
    want = _reference(inputs, ops.Sum)
    for out in outputs:
        np.testing.assert_allclose(out, want, rtol=1e-12)
        assert out.tobytes() == outputs[0].tobytes()
    if size > 1:  # the same bits as the in-place ring: each element reduced in one order
        _, in_place = _allreduce(size, n, np.float64, ops.Sum, chunk_bytes=40)
        assert outputs[0].tobytes() == in_place[0].tobytes()


@pytest.mark.parametrize("size", range(1, 6))
@pytest.mark.parametrize("n", [0, 1, 7, 97, 1000])
@pytest.mark.parametrize("out_of_place", [False, True])
def test_finish_runs_once_per_element_before_the_all_gather(size, n, out_of_place):
    """finish= sees every element exactly once over all ranks, after its reduction is
    complete, and every rank ends with the finished bits (as finishing afterwards)."""
    inputs = [_data(r, n, np.float32) for r in range(size)]
    seen = [np.zeros(n, np.int64) for _ in range(size)]

    def body(rank, links):
        buf = inputs[rank].copy() if not out_of_place else np.full(n, np.nan, np.float32)
        source = SegmentedBuffer([inputs[rank]]) if out_of_place else None

        def finish(views):
            for view in views:
                start = (view.ctypes.data - buf.ctypes.data) // buf.itemsize if n else 0
                seen[rank][start : start + view.size] += 1
                ops.finish_reduction(view, ops.Average, 3.0, size)

        ring.allreduce(SegmentedBuffer([buf]), ops.Average, rank, size,
                       links.get((rank - 1) % size), links.get((rank + 1) % size), 24,
                       source=source, finish=finish)
        return buf

    outputs = run_ranks(size, body)
    assert (sum(seen) == 1).all()  # each element finished once, on one rank
    _, summed = _allreduce(size, n, np.float32, ops.Average, chunk_bytes=24)
    want = summed[0].copy()
    ops.finish_reduction(want, ops.Average, 3.0, size)
    for out in outputs:
        assert out.tobytes() == want.tobytes()


@pytest.mark.parametrize("size", [2, 3, 4, 7])
def test_reduce_scatter_leaves_own_segment(size):
    n = 29
    counts = even_counts(n, size)

    def body(rank, links):
        buf = np.arange(n, dtype=np.float64) * (rank + 1)
        segs = ring.reduce_scatter(SegmentedBuffer([buf]), ops.Sum, rank, size,
                                   links[(rank - 1) % size], links[(rank + 1) % size], 16, counts)
        lo, hi = segs[rank]
        return buf[lo:hi]

    total = sum(range(1, size + 1))
    start = 0
    for rank, got in enumerate(run_ranks(size, body)):
        np.testing.assert_array_equal(got, np.arange(start, start + counts[rank]) * total)
        start += counts[rank]


@pytest.mark.parametrize("size", [1, 2, 3, 6])
@pytest.mark.parametrize("root", [0, 1])
def test_broadcast_pipeline(size, root):
    root = root % size

    def body(rank, links):
        buf = np.full(1000, float(rank))
        ring.broadcast(SegmentedBuffer([buf]), root, rank, size, links.get((rank - 1) % size),
                       links.get((rank + 1) % size), 128)
        return buf

    for out in run_ranks(size, body):
        np.testing.assert_array_equal(out, np.full(1000, float(root)))


@pytest.mark.parametrize("size", [2, 3, 5])
def test_allgather_variable_segments(size):
    counts = [r + 1 for r in range(size)]
    starts = np.cumsum([0] + counts)

    def body(rank, links):
        buf = np.zeros(sum(counts))
        buf[starts[rank] : starts[rank + 1]] = rank
        ring.all_gather_segments(SegmentedBuffer([buf]), ring.segments_of(counts), rank, size,
                                 links[(rank - 1) % size], links[(rank + 1) % size], 8)
        return buf

    want = np.repeat(np.arange(size, dtype=float), counts)
    for out in run_ranks(size, body):
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_alltoall_uneven(size):
    # rank r sends (r + d) % 3 elements to rank d, each valued 100 * r + d
    def sends(r):
        return [(r + d) % 3 for d in range(size)]

    def body(rank, links):
        send_counts = sends(rank)
        send = np.concatenate([np.full(c, 100 * rank + d) for d, c in enumerate(send_counts)])
        recv_counts = [sends(s)[rank] for s in range(size)]
        recv = np.empty(sum(recv_counts), send.dtype)
        ring.alltoall(send, send_counts, recv, recv_counts, rank, size, links, 16)
        return recv, recv_counts

    for rank, (recv, recv_counts) in enumerate(run_ranks(size, body)):
        want = np.concatenate([np.full(c, 100 * s + rank) for s, c in enumerate(recv_counts)])
        np.testing.assert_array_equal(recv, want)
