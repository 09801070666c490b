"""The engine's wake-ups coalesce without ever being lost (real sockets, no ranks)."""

from __future__ import annotations

import socket
import types

from hvd_spark.collectives.tcp.engine import TcpEngine


class _RacingSocket:
    """The wake socket's read end; while the engine drains it, a submitter wakes."""

    def __init__(self, sock: socket.socket, on_recv) -> None:
        self.sock, self.on_recv = sock, on_recv

    def recv(self, n: int) -> bytes:
        data = self.sock.recv(n)
        if self.on_recv is not None:
            self.on_recv, hook = None, self.on_recv
            hook()
        return data


def test_a_wake_during_the_drain_is_never_lost():
    """Invariant: when the flag says a wake byte is on its way, one is in the socket (else
    every later wake is skipped and held work waits for the idle poll)."""
    r, w = socket.socketpair()
    r.setblocking(False)
    state = types.SimpleNamespace(_wake_w=w, _wake_pending=False)
    state._wake_r = _RacingSocket(r, lambda: TcpEngine._wake(state))
    try:
        TcpEngine._wake(state)  # the first submission
        TcpEngine._drain_wake(state)  # a second one lands while this reads
        assert not state._wake_pending or _readable(r)
        state._wake_r.on_recv = None
        TcpEngine._wake(state)  # and the next wake still goes out
        assert _readable(r)
    finally:
        r.close()
        w.close()


def _readable(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(16, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return False
