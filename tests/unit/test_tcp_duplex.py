"""One ring step sent and received at once from the caller's thread (``tcp.duplex``),
over real loopback TCP sockets."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from hvd_spark.collectives import ops
from hvd_spark.collectives.tcp import duplex, wire
from hvd_spark.collectives.tcp.links import TcpLink
from hvd_spark.errors import CollectiveError, CollectiveTimeoutError, PeerDisconnectedError
from tests.threads import run_on_threads

_OPEN: list[TcpLink] = []


def _tcp_links(timeout: float = 10.0) -> tuple[TcpLink, TcpLink]:
    """Rank 0's link to rank 1 and rank 1's to rank 0, over one loopback connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    for sock in (a, b):
        wire.tune(sock)
        sock.settimeout(timeout)
    links = TcpLink(a, 1), TcpLink(b, 0)
    _OPEN.extend(links)
    return links


@pytest.fixture(autouse=True)
def _close_links():
    yield
    while _OPEN:
        link = _OPEN.pop()
        link.close()
        if link._sender is not None:
            link._sender.join(5)


def _views(rank: int, sizes: list[int]) -> list[np.ndarray]:
    return [np.arange(n, dtype=np.float32) * (rank + 1) + i for i, n in enumerate(sizes)]


SIZES = [1001, 200_000, 50_003]  # one step of about 1 MB over three pieces


def test_reduces_onto_bases_exactly_across_pieces():
    links = _tcp_links()

    def body(rank):
        link = links[rank]
        mine = _views(rank, SIZES)
        target = [np.full(n, np.nan, np.float32) for n in SIZES]
        duplex.exchange(link, mine, link, target, ops.ReduceOp.Sum, mine)
        return target, link.sock.gettimeout()

    for target, timeout in run_on_threads([0, 1], body):
        for got, a, b in zip(target, _views(0, SIZES), _views(1, SIZES)):
            np.testing.assert_array_equal(got, a + b)
        assert timeout == 10.0  # the deadline is back for the next blocking wait


def test_receives_into_views_in_place_and_reduces_in_place():
    links = _tcp_links()

    def body(rank):
        link = links[rank]
        mine = _views(rank, SIZES)
        copy = [np.empty(n, np.float32) for n in SIZES]
        duplex.exchange(link, mine, link, copy)
        # (A ring step never sends what it reduces into: send a copy.)
        duplex.exchange(link, [a.copy() for a in mine], link, mine, ops.ReduceOp.Max)
        return copy, mine

    (copy0, max0), (copy1, max1) = run_on_threads([0, 1], body)
    for got, want in zip(copy0, _views(1, SIZES)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(copy1, _views(0, SIZES)):
        np.testing.assert_array_equal(got, want)
    for a, b, want in zip(max0, max1, _views(1, SIZES)):
        np.testing.assert_array_equal(a, want)
        np.testing.assert_array_equal(b, want)


def test_speaks_the_same_bytes_as_the_links_usual_path():
    """One side steps with ``exchange``, the other with send / recv_reduce / wait_sent."""
    links = _tcp_links()

    def body(rank):
        link = links[rank]
        mine = _views(rank, SIZES)
        sent = [a.copy() for a in mine]
        if rank == 0:
            duplex.exchange(link, sent, link, mine, ops.ReduceOp.Sum)
        else:
            link.send(sent)  # over 32 KB: from the sender thread
            link.recv_reduce(mine, ops.ReduceOp.Sum)
            link.wait_sent()
        return mine

    for got in run_on_threads([0, 1], body):
        for g, a, b in zip(got, _views(0, SIZES), _views(1, SIZES)):
            np.testing.assert_array_equal(g, a + b)


def test_a_silent_peer_times_out_naming_it():
    link, other = _tcp_links(timeout=0.5)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="rank 1"):
        duplex.exchange(link, _views(0, SIZES), link, _views(0, SIZES), ops.ReduceOp.Sum)
    assert time.monotonic() - start < 5
    assert link.sock.gettimeout() == 0.5


def test_a_peer_that_closes_mid_step_is_a_disconnect():
    link, other = _tcp_links()
    threading.Timer(0.2, other.close).start()
    start = time.monotonic()
    with pytest.raises(PeerDisconnectedError, match="rank 1"):
        # 64 MB: more than the socket buffers take, so the step is mid-way at the close.
        big = [np.ones(16 << 20, np.float32)]
        duplex.exchange(link, big, link, [np.ones(16 << 20, np.float32)], ops.ReduceOp.Sum)
    assert time.monotonic() - start < 5


def test_a_step_of_another_size_is_a_protocol_error():
    links = _tcp_links()

    def body(rank):
        link = links[rank]
        sizes = SIZES if rank == 0 else [n + 1 for n in SIZES]
        with pytest.raises(CollectiveError, match="protocol error with rank"):
            duplex.exchange(link, _views(rank, sizes), link, _views(rank, sizes),
                            ops.ReduceOp.Sum)

    run_on_threads([0, 1], body)


def test_applies_to_large_steps_between_idle_tcp_links_only():
    link, other = _tcp_links()
    assert duplex.applies(link, duplex.MIN_BYTES, link, 0)
    assert not duplex.applies(link, duplex.MIN_BYTES - 1, link, duplex.MIN_BYTES - 1)
    assert not duplex.applies(object(), duplex.MIN_BYTES, link, duplex.MIN_BYTES)
    link.send([np.ones(1 << 20, np.uint8)])  # large: waits in the sender thread
    assert not duplex.applies(link, duplex.MIN_BYTES, link, duplex.MIN_BYTES)
    other.recv_into([np.empty(1 << 20, np.uint8)])
    link.wait_sent()
    assert duplex.applies(link, duplex.MIN_BYTES, link, duplex.MIN_BYTES)
