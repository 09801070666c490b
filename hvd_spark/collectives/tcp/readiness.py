"""Which sockets are ready: waiting for them with a deadline, or polling a while.

select(2) is the cheapest way to wait, but takes no descriptor from 1024 on
(FD_SETSIZE); those sets use poll(2).
"""

from __future__ import annotations

import math
import os
import select
import socket
import time
from collections.abc import Sequence

# Gives up the CPU between looks (a C function: no Python frame per look).
_yield = getattr(os, "sched_yield", lambda: None)
# select() takes file descriptors below this only (FD_SETSIZE).
_SELECT_FD_LIMIT = 1024


def wait_readable(socks: Sequence[socket.socket],
                  timeout: float | None) -> list[socket.socket]:
    """Those of ``socks`` that are readable (data, or the peer closed) within ``timeout``
    seconds (None: no limit; 0: just look).

    select(2), the cheapest, takes no descriptor from 1024 on (FD_SETSIZE); a process
    holding many files gets such numbers (Spark raises the open-file limit), and select
    then raised ValueError: those sets use poll(2), whose timeouts are whole
    milliseconds (rounded up).
    """
    for sock in socks:  # (a loop: cheaper than all() on this hot path)
        if sock.fileno() >= _SELECT_FD_LIMIT:
            break
    else:
        return select.select(socks, [], [], timeout)[0]
    return _poll(socks, (), timeout)


def _poll(readable: Sequence[socket.socket], writable: Sequence[socket.socket],
          timeout: float | None) -> list[socket.socket]:
    """poll(2) for descriptors select(2) cannot take: the sockets that are ready."""
    poller = select.poll()
    by_fd = {}
    for sock in [*readable, *writable]:
        events = (select.POLLIN if sock in readable else 0) | (
            select.POLLOUT if sock in writable else 0)
        poller.register(sock, events)
        by_fd[sock.fileno()] = sock
    millis = None if timeout is None else math.ceil(max(0.0, timeout) * 1000)
    return [by_fd[fd] for fd, _ in poller.poll(millis)]


def wait_ready(readable: Sequence[socket.socket], writable: Sequence[socket.socket],
               timeout: float | None) -> bool:
    """Wait until one of ``readable`` can be read or one of ``writable`` written, at most
    ``timeout`` seconds (None: no limit); False when the time ran out.

    As ``wait_readable``: select(2) below descriptor 1024, poll(2) from there on.
    """
    if all(sock.fileno() < _SELECT_FD_LIMIT for sock in [*readable, *writable]):
        ready = select.select(readable, writable, [], timeout)
        return bool(ready[0] or ready[1])
    return bool(_poll(readable, writable, timeout))


def poll_readable(socks: list[socket.socket], spin_s: float) -> list[socket.socket]:
    """Poll ``socks`` for up to ``spin_s`` seconds; return those readable (empty when the
    time is up: the caller then blocks as usual).

    A receiver blocked in the kernel makes its sender pay for the wake-up (50-70 us per
    9-byte notice on a VM) and wakes up late itself; a polling one costs a microsecond
    or two per look, and its sender nothing extra. Between looks it yields the CPU
    (``sched_yield``: at once when nothing else waits for this CPU): where other
    processes load the machine, a rank spinning out its whole slice kept the rank it
    waits for off the CPU, and a 1 KB allreduce took 1-1.7 ms instead of 20-400 us.
    """
    if spin_s <= 0:
        return []  # then just block
    until = time.monotonic() + spin_s
    for sock in socks:  # (loops, not closures: a small call runs this every time)
        if sock.fileno() >= _SELECT_FD_LIMIT:
            while True:
                readable = _poll(socks, (), 0.0)
                if readable or time.monotonic() >= until:
                    return readable
                _yield()
    while True:
        readable = select.select(socks, [], [], 0.0)[0]
        if readable or time.monotonic() >= until:
            return readable
        _yield()
