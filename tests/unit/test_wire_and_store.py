"""Authenticated sockets and the rendezvous store, over real loopback sockets."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from hvd_spark.collectives.tcp import readiness, wire
from hvd_spark.collectives.tcp.store import StoreClient, StoreServer
from hvd_spark.errors import (
    AuthenticationError,
    CollectiveTimeoutError,
    PeerDisconnectedError,
    RendezvousTimeoutError,
)

SECRET = b"s" * 32


def test_store_set_get_and_custom_handler():
    server = StoreServer(SECRET, handlers={"double": lambda x: 2 * x})
    try:
        client = StoreClient(("127.0.0.1", server.port), SECRET)
        threading.Timer(0.1, lambda: server.set("late", [1, 2])).start()
        assert client.get("late", 5) == [1, 2]
        client.set("k", {"a": 1})
        assert server.get("k", 1) == {"a": 1}
        assert client.call("double", 21) == 42
        with pytest.raises(RendezvousTimeoutError):
            client.get("never", 0.2)
        client.close()
    finally:
        server.close()


def test_close_closes_a_connection_whose_handler_is_still_running():
    # A handler that outlasts the server (an elastic join waiting on its driver) must not
    # keep its connection open: close() gives it a moment, then closes the socket.
    release = threading.Event()
    server = StoreServer(SECRET, handlers={"wait": lambda: release.wait(30)})
    client = StoreClient(("127.0.0.1", server.port), SECRET)
    seen: list = []

    def call() -> None:
        try:
            seen.append(client.call("wait"))
        except PeerDisconnectedError as exc:
            seen.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        deadline = time.monotonic() + 5
        while not server._conns and time.monotonic() < deadline:  # noqa: SLF001 - test
            time.sleep(0.01)
        (conn,) = list(server._conns)  # noqa: SLF001 - the socket under test
        server.close()
        assert conn.fileno() == -1  # closed, while its handler still runs
        caller.join(5)
        assert not caller.is_alive()
        assert len(seen) == 1 and isinstance(seen[0], PeerDisconnectedError), seen
    finally:
        release.set()
        client.close()
        server.close()


def test_wrong_secret_is_rejected_and_store_keeps_serving():
    server = StoreServer(SECRET)
    try:
        with pytest.raises(AuthenticationError):
            StoreClient(("127.0.0.1", server.port), b"x" * 32, timeout=5)
        # A raw connection that sends garbage is dropped too.
        raw = socket.create_connection(("127.0.0.1", server.port))
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"\0" * 64)
        raw.settimeout(5)
        try:
            dropped = raw.recv(100) == b""
        except ConnectionResetError:
            dropped = True
        assert dropped, "the store must drop a connection that does not authenticate"
        raw.close()
        good = StoreClient(("127.0.0.1", server.port), SECRET)
        good.set("still", "alive")
        assert good.get("still", 1) == "alive"
        assert server.rejected_connections >= 1
    finally:
        server.close()


def test_frames_roundtrip_over_socketpair():
    a, b = socket.socketpair()
    wire.send_obj(a, {"x": [1, 2, 3]})
    assert wire.recv_obj(b) == {"x": [1, 2, 3]}
    a.close()
    with pytest.raises(PeerDisconnectedError, match="peer closed the connection"):
        wire.recv_obj(b)


def test_parse_addr():
    assert wire.parse_addr("10.0.0.1:99") == ("10.0.0.1", 99)
    assert wire.parse_addr("[::1]:5") == ("::1", 5)
    with pytest.raises(ValueError):
        wire.parse_addr("nohost")


def test_remove_segments_only_touches_the_job(tmp_path, monkeypatch):
    from hvd_spark.collectives.tcp import shm

    monkeypatch.setattr(shm, "_shm_dir", lambda: str(tmp_path))
    mine, other = shm.job_tag(b"a" * 32), shm.job_tag(b"b" * 32)
    assert mine != other and len(mine) == 12
    for name in (f"hvd_spark_{mine}_1_x", f"hvd_spark_{mine}_2_y", f"hvd_spark_{other}_1_z"):
        (tmp_path / name).write_bytes(b"")
    assert shm.remove_segments(mine) == 2
    assert [p.name for p in tmp_path.iterdir()] == [f"hvd_spark_{other}_1_z"]


def test_recv_exact_collects_a_message_sent_in_pieces():
    """A frame that arrives in parts (small, or over the one-recv limit) is read whole."""
    import time

    a, b = socket.socketpair()
    big = bytes(range(256)) * 1024  # over the one-recv size

    def trickle():
        for data in (b"hel", b"lo", big[:1000], big[1000:]):
            a.sendall(data)
            time.sleep(0.02)

    sender = threading.Thread(target=trickle)
    sender.start()
    b.settimeout(5)
    assert wire.recv_exact(b, 5) == b"hello"
    assert wire.recv_exact(b, len(big)) == big
    sender.join()
    a.close()
    b.close()


def test_recv_exact_names_a_closed_peer_and_a_timeout():
    a, b = socket.socketpair()
    b.settimeout(0.2)
    with pytest.raises(CollectiveTimeoutError, match="no data from rank 3"):
        wire.recv_exact(b, 8, "rank 3")
    a.sendall(b"abc")
    a.close()
    with pytest.raises(PeerDisconnectedError, match="rank 3 closed the connection"):
        wire.recv_exact(b, 8, "rank 3")  # 3 of 8 bytes, then the end
    with pytest.raises(PeerDisconnectedError, match="rank 3 closed the connection"):
        wire.recv_exact(b, 8, "rank 3")  # nothing at all
    b.close()


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_send_pieces_now_sends_what_fits_and_returns_the_rest_in_order(timeout):
    """With a deadline the descriptor is written directly (non-blocking), without one
    through the timeout switch: either way a full socket takes what fits, never waits,
    and what is left follows in order; a message already there is read at once."""
    a, b = socket.socketpair()
    a.settimeout(timeout)
    b.settimeout(timeout)
    frames = [bytes([i]) * 300_000 for i in range(4)]  # more than the socket holds
    rest = wire.send_pieces_now(a, wire.frame_pieces(frames), "rank 1")
    assert rest and sum(p.nbytes for p in rest) < sum(len(f) + 8 for f in frames)
    received = []
    reader = threading.Thread(target=lambda: received.extend(
        wire.recv_frame(b, "rank 0") for _ in frames))
    reader.start()
    wire.send_pieces(a, rest, "rank 1")
    reader.join(10)
    assert [bytes(f) for f in received] == frames
    wire.send_frame(a, b"small")
    assert wire.recv_frame(b) == b"small"
    b.close()
    with pytest.raises(PeerDisconnectedError, match="rank 1 dropped the connection"):
        for _ in range(100):  # the first may still go into the socket's buffer
            wire.send_pieces_now(a, wire.frame_pieces([b"x" * 1000]), "rank 1")
    a.close()


def test_poll_readable_returns_on_data_or_when_the_spin_is_over():
    import time

    a, b = socket.socketpair()
    start = time.monotonic()
    assert readiness.poll_readable([b], 0.05) == []  # nothing comes: it gives up after the spin
    assert 0.05 <= time.monotonic() - start < 1.0
    start = time.monotonic()
    assert readiness.poll_readable([b], 0.0) == []  # no spin: at once
    assert time.monotonic() - start < 0.05
    threading.Timer(0.02, lambda: a.sendall(b"x")).start()
    start = time.monotonic()
    assert readiness.poll_readable([a, b], 5.0) == [b]  # when the byte arrives, long before 5 s
    assert time.monotonic() - start < 2.0 and b.recv(1) == b"x"
    a.close()
    b.close()


def test_only_threads_of_waiting_callers_may_poll():
    """The engine marks a waiting caller's progress; other threads (the background one,
    beside the caller's compute) block instead of polling."""
    from hvd_spark.collectives.communicator import caller_waiting, may_poll

    seen = {}
    assert not may_poll()
    with caller_waiting():
        assert may_poll()
        with caller_waiting():
            assert may_poll()
        assert may_poll()  # nested: still inside the outer one
        other = threading.Thread(target=lambda: seen.setdefault("other", may_poll()))
        other.start()
        other.join()
    assert not may_poll() and seen == {"other": False}
