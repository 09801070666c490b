"""Ring and pairwise algorithms over Links: pure logic, no sockets of their own.

Ring all-reduce = reduce-scatter then all-gather; each step sends one segment to
the right neighbour while receiving another from the left, chunk by chunk, so a
chunk is on the wire while the previous one is being reduced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer, even_counts, nbytes_of, offsets
from hvd_spark.collectives.tcp import duplex
from hvd_spark.collectives.tcp.links import Link


def _chunks(buf: SegmentedBuffer, seg: tuple[int, int], chunk_bytes: int) -> list:
    return list(buf.chunks(seg[0], seg[1], chunk_bytes))


def _exchange(
    send_link: Link,
    send_chunks: list,
    recv_link: Link,
    recv_chunks: list,
    op: ops.ReduceOp | None,
    base_chunks: list | None = None,
) -> None:
    """Send ``send_chunks`` while receiving ``recv_chunks`` (reducing when ``op``, onto
    ``base_chunks`` when given: ``recv = op(base, incoming)``)."""
    for i in range(max(len(send_chunks), len(recv_chunks))):
        if (i < len(send_chunks) and i < len(recv_chunks)
                and duplex.applies(send_link, nbytes_of(send_chunks[i]),
                                   recv_link, nbytes_of(recv_chunks[i]))):
            duplex.exchange(send_link, send_chunks[i], recv_link, recv_chunks[i], op,
                            None if base_chunks is None else base_chunks[i])
            continue
        if i < len(send_chunks):
            send_link.send(send_chunks[i])
        if i < len(recv_chunks):
            if op is None:
                recv_link.recv_into(recv_chunks[i])
            elif base_chunks is None:
                recv_link.recv_reduce(recv_chunks[i], op)
            else:
                recv_link.recv_reduce(recv_chunks[i], op, base_chunks[i])
    send_link.wait_sent()


def segments_of(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Turn per-rank element counts into ``[start, stop)`` ranges."""
    starts = offsets(counts)
    return [(s, s + c) for s, c in zip(starts, counts)]


def reduce_scatter(
    buf: SegmentedBuffer,
    op: ops.ReduceOp,
    rank: int,
    size: int,
    left: Link,
    right: Link,
    chunk_bytes: int,
    counts: Sequence[int] | None = None,
) -> list[tuple[int, int]]:
    """Reduce in place so that segment ``rank`` holds the reduction over all ranks.

    Args:
        counts: Elements per segment (default: an even split).

    Returns:
        The segment ranges used.
    """
    segs = segments_of(counts if counts is not None else even_counts(buf.size, size))
    _reduce_scatter_steps(buf, op, rank, size, left, right, chunk_bytes, segs)
    return segs


def all_gather_segments(
    buf: SegmentedBuffer,
    segs: Sequence[tuple[int, int]],
    rank: int,
    size: int,
    left: Link,
    right: Link,
    chunk_bytes: int,
) -> None:
    """Given segment ``rank`` complete on each rank, fill in all the others."""
    for step in range(size - 1):
        send_seg = segs[(rank - step) % size]
        recv_seg = segs[(rank - step - 1) % size]
        _exchange(
            right,
            _chunks(buf, send_seg, chunk_bytes),
            left,
            _chunks(buf, recv_seg, chunk_bytes),
            None,
        )


def allreduce(
    buf: SegmentedBuffer,
    op: ops.ReduceOp,
    rank: int,
    size: int,
    left: Link,
    right: Link,
    chunk_bytes: int,
    source: SegmentedBuffer | None = None,
    finish: Callable[[list[np.ndarray]], None] | None = None,
) -> None:
    """Ring all-reduce: reduce-scatter, then all-gather, block by block.

    In place, or with ``source`` (the caller's inputs, laid out as ``buf``) out of
    place: the first send and every first reduction of a segment read ``source``, so
    ``buf`` needs no copy of the input beforehand (every element of ``buf`` is written
    before it is read).

    ``finish(views)``, when given, runs on each segment this rank completes, before the
    all-gather sends it on (an Average's division, a postscale): once per element in
    the whole ring, while the segment is in cache, instead of a pass over the whole
    result on every rank afterwards. Every rank receives the same finished bits.

    The buffer is processed in blocks of ``size`` chunks, each going through the
    whole ring (reduce-scatter then all-gather) before the next. The message count
    is the same as one pass over the whole buffer, but a chunk is sent on in the
    all-gather while it is still in cache from being reduced, which saves a trip to
    memory per byte.
    """
    if buf.size == 0:
        return
    if size == 1:
        if source is not None:
            for dst, src in zip(buf.views(0, buf.size), source.views(0, source.size)):
                np.copyto(dst, src)
        if finish is not None:
            finish(buf.views(0, buf.size))
        return
    block = size * max(1, chunk_bytes // buf.itemsize)
    for lo in range(0, buf.size, block):
        hi = min(buf.size, lo + block)
        segs = [(lo + a, lo + b) for a, b in segments_of(even_counts(hi - lo, size))]
        _ring_steps(buf, op, rank, size, left, right, chunk_bytes, segs, source, finish)


def _reduce_scatter_steps(buf, op, rank, size, left, right, chunk_bytes, segs,
                          source: SegmentedBuffer | None = None) -> None:
    """size-1 steps after which segment ``rank`` is reduced over all ranks.

    Each segment reaches each rank once, so with ``source`` a received segment is
    reduced onto the caller's input, and only the first step sends from the input.
    """
    for step in range(size - 1):
        send_seg = segs[(rank - step - 1) % size]
        recv_seg = segs[(rank - step - 2) % size]
        send_from = source if source is not None and step == 0 else buf
        bases = _chunks(source, recv_seg, chunk_bytes) if source is not None else None
        _exchange(right, _chunks(send_from, send_seg, chunk_bytes),
                  left, _chunks(buf, recv_seg, chunk_bytes), op, bases)


def _ring_steps(buf, op, rank, size, left, right, chunk_bytes, segs,
                source: SegmentedBuffer | None = None,
                finish: Callable[[list[np.ndarray]], None] | None = None) -> None:
    _reduce_scatter_steps(buf, op, rank, size, left, right, chunk_bytes, segs, source)
    if finish is not None:
        finish(buf.views(*segs[rank]))
    all_gather_segments(buf, segs, rank, size, left, right, chunk_bytes)


def broadcast(
    buf: SegmentedBuffer,
    root: int,
    rank: int,
    size: int,
    left: Link,
    right: Link,
    chunk_bytes: int,
) -> None:
    """Pipelined chain broadcast from ``root`` around the ring."""
    if size == 1 or buf.size == 0:
        return
    position = (rank - root) % size
    for chunk in buf.chunks(0, buf.size, chunk_bytes):
        if position > 0:
            left.recv_into(chunk)
        if position < size - 1:
            right.send(chunk)
    if position < size - 1:
        right.wait_sent()


def alltoall(
    send: np.ndarray,
    send_counts: Sequence[int],
    recv: np.ndarray,
    recv_counts: Sequence[int],
    rank: int,
    size: int,
    links: dict[int, Link],
    chunk_bytes: int,
) -> None:
    """Pairwise exchange: in step k send to rank+k and receive from rank-k.

    Args:
        send, recv: 1-D arrays; block j of ``send`` goes to rank j.
        send_counts, recv_counts: Elements per rank block.
    """
    send_off, recv_off = offsets(send_counts), offsets(recv_counts)
    own = send[send_off[rank] : send_off[rank] + send_counts[rank]]
    recv[recv_off[rank] : recv_off[rank] + recv_counts[rank]] = own
    sbuf, rbuf = SegmentedBuffer([send]), SegmentedBuffer([recv])
    for step in range(1, size):
        dst, src = (rank + step) % size, (rank - step) % size
        s_lo = send_off[dst]
        r_lo = recv_off[src]
        _exchange(
            links[dst],
            list(sbuf.chunks(s_lo, s_lo + send_counts[dst], chunk_bytes)),
            links[src],
            list(rbuf.chunks(r_lo, r_lo + recv_counts[src], chunk_bytes)),
            None,
        )
