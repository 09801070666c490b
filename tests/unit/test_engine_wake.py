"""The engine's wake-ups coalesce without ever being lost (its real control channel, no
ranks)."""

from __future__ import annotations

import socket

from hvd_spark.collectives.tcp.control import ControlChannel


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
    channel = ControlChannel(0, 1, {}, lambda: None, lambda exc: None)
    r = channel.wake_r
    channel.wake_r = _RacingSocket(r, channel.wake)
    try:
        channel.wake()  # the first submission
        channel.drain_wake()  # a second one lands while this reads
        assert not channel._wake_pending or _readable(r)
        channel.wake_r.on_recv = None
        channel.wake()  # and the next wake still goes out
        assert _readable(r)
    finally:
        channel.wake_r = r
        channel.close()


def _readable(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(16, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return False
