"""One ring step over TCP from the caller's thread alone: send and receive at once.

A ring step sends a chunk to one neighbour while it receives another from the other.
``TcpLink.send`` hands a large chunk to a sender thread and the caller then receives
it whole before reducing: two thread hand-offs per step (50-70 us each on a VM), and a
reduction that reads the received chunk back from memory after it left the cache.

``exchange`` instead drives both sockets without blocking, in one thread: it writes
what the kernel takes, reads what has arrived, and reduces each piece as it lands,
while it is still in cache. The bytes on the wire are the links' own (header, then
payload), so either side may use either path.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

import numpy as np

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import nbytes_of
from hvd_spark.collectives.tcp import readiness
from hvd_spark.collectives.tcp.links import HEADER, KIND_DATA, TcpLink, as_bytes, check_header
from hvd_spark.errors import CollectiveTimeoutError, PeerDisconnectedError

# Steps smaller than this go the links' usual way: the kernel's buffers take them whole.
MIN_BYTES = 64 * 1024
# Received bytes are reduced once this many have gathered (or at the end): a piece
# that fits in the core's cache beside its base and target.
_REDUCE_BYTES = 128 * 1024


def applies(send_link: object, send_bytes: int, recv_link: object, recv_bytes: int) -> bool:
    """Whether ``exchange`` may run a step between these links: TCP on both sides, large
    enough, and no send still in either's sender thread (its bytes must go first, and it
    writes to a socket this step makes non-blocking)."""
    return (type(send_link) is TcpLink and type(recv_link) is TcpLink
            and max(send_bytes, recv_bytes) >= MIN_BYTES
            and send_link.idle() and recv_link.idle())


class _Outgoing:
    """The bytes one step sends: the header, then each view's bytes."""

    def __init__(self, link: TcpLink, views: Sequence[np.ndarray]) -> None:
        self.link = link
        self.pieces = [memoryview(HEADER.pack(KIND_DATA, nbytes_of(views)))]
        self.pieces += [as_bytes(v) for v in views if v.nbytes]
        self.index = 0
        self.offset = 0

    def done(self) -> bool:
        return self.index >= len(self.pieces)

    def send_some(self, sock: socket.socket) -> bool:
        """Write what the kernel takes now; True if anything went."""
        try:
            sent = sock.send(self.pieces[self.index][self.offset:])
        except BlockingIOError:
            return False
        except OSError as exc:
            raise PeerDisconnectedError(
                f"rank {self.link.peer} dropped the connection ({exc})") from None
        self.offset += sent
        if self.offset == len(self.pieces[self.index]):
            self.index, self.offset = self.index + 1, 0
        return sent > 0


class _Incoming:
    """The bytes one step receives: the header, then the payload, either straight into
    the views or (when reducing) into scratch, reduced into the views piece by piece."""

    def __init__(self, link: TcpLink, views: Sequence[np.ndarray], op: ops.ReduceOp | None,
                 bases: Sequence[np.ndarray] | None) -> None:
        self.link = link
        self.views = [v for v in views if v.nbytes]
        self.bases = None if bases is None else [b for b in bases if b.nbytes]
        self.op = op
        self.nbytes = nbytes_of(views)
        self.header = bytearray(HEADER.size)
        self.scratch = link.scratch(self.nbytes) if op is not None else None
        if self.scratch is None:
            targets = [as_bytes(v) for v in self.views]
        else:
            targets = [memoryview(self.scratch)] if self.nbytes else []
        self.pieces = [memoryview(self.header), *targets]
        self.index = 0
        self.offset = 0
        self.received = 0  # payload bytes
        self.reduced = 0
        self.view_index = 0  # the view the next reduction starts in
        self.view_start = 0  # payload offset where that view starts

    def done(self) -> bool:
        return self.index >= len(self.pieces)

    def recv_some(self, sock: socket.socket) -> bool:
        """Read what has arrived; True if anything came."""
        piece = self.pieces[self.index]
        try:
            got = sock.recv_into(piece[self.offset:])
        except BlockingIOError:
            return False
        except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError) as exc:
            raise PeerDisconnectedError(
                f"rank {self.link.peer} dropped the connection ({exc})") from None
        if got == 0:
            raise PeerDisconnectedError(f"rank {self.link.peer} closed the connection")
        self.offset += got
        if self.index > 0:
            self.received += got
        if self.offset == len(piece):
            if self.index == 0:
                kind, nbytes = HEADER.unpack(self.header)
                check_header(kind, nbytes, KIND_DATA, self.nbytes, self.link.peer)
            self.index, self.offset = self.index + 1, 0
        if self.op is not None and (self.received - self.reduced >= _REDUCE_BYTES
                                    or (self.received == self.nbytes > self.reduced)):
            self._reduce_upto(self.received)
        return True

    def _reduce_upto(self, upto: int) -> None:
        """Reduce the whole elements of the payload below ``upto`` not yet reduced."""
        scratch = self.scratch
        while self.view_index < len(self.views):
            view = self.views[self.view_index]
            lo = self.reduced - self.view_start
            hi = min(view.nbytes, upto - self.view_start)
            hi -= hi % view.itemsize
            if hi > lo:
                first, last = lo // view.itemsize, hi // view.itemsize
                incoming = scratch[self.reduced : self.view_start + hi].view(view.dtype)
                base = None if self.bases is None else self.bases[self.view_index][first:last]
                ops.reduce_into(view[first:last], incoming, self.op, base)
                self.reduced = self.view_start + hi
            if hi < view.nbytes:
                return
            self.view_start += view.nbytes
            self.view_index += 1


def exchange(send_link: TcpLink, send_views: Sequence[np.ndarray], recv_link: TcpLink,
             recv_views: Sequence[np.ndarray], op: ops.ReduceOp | None = None,
             bases: Sequence[np.ndarray] | None = None) -> None:
    """Send ``send_views`` to one peer while receiving ``recv_views`` from another (or
    the same), reducing with ``op`` onto ``bases`` as ``TcpLink.recv_reduce`` does.

    Every wait is bounded by the sockets' timeout: no progress within it raises
    CollectiveTimeoutError naming the peer.
    """
    out = _Outgoing(send_link, send_views)
    inc = _Incoming(recv_link, recv_views, op, bases)
    ssock, rsock = send_link.sock, recv_link.sock
    timeouts = {sock: sock.gettimeout() for sock in (ssock, rsock)}
    timeout = max((t for t in timeouts.values() if t is not None), default=None)
    try:
        for sock in timeouts:
            sock.setblocking(False)
        while not (out.done() and inc.done()):
            moved = (not out.done() and out.send_some(ssock))
            moved = (not inc.done() and inc.recv_some(rsock)) or moved
            if moved:
                continue
            readable = [rsock] if not inc.done() else []
            writable = [ssock] if not out.done() else []
            if not readiness.wait_ready(readable, writable, timeout):
                waiting = sorted(({recv_link.peer} if readable else set())
                                 | ({send_link.peer} if writable else set()))
                raise CollectiveTimeoutError(
                    f"no progress with rank {' or '.join(map(str, waiting))} within "
                    f"{timeout} s; it may be stalled or dead (raise HVD_SPARK_TIMEOUT if it "
                    "is just slow)")
    finally:
        for sock, value in timeouts.items():
            sock.settimeout(value)
