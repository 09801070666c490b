"""Point-to-point links between two ranks, the only thing the ring algorithms touch.

A ``Link`` moves lists of array views. ``TcpLink`` streams them over an
authenticated socket, sending from a helper thread so a rank can send to its
right neighbour while it receives from its left one.
"""

from __future__ import annotations

import abc
import queue
import socket
import struct
import threading
from collections.abc import Sequence

import numpy as np

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import nbytes_of
from hvd_spark.collectives.tcp import wire
from hvd_spark.errors import CollectiveError, CollectiveTimeoutError

HEADER = struct.Struct("<BQ")
KIND_DATA = 1
KIND_SHM_READY = 2
KIND_SHM_ACK = 3

# Sends up to this size go out from the caller's thread: the kernel's socket
# buffers take them whole, so no peer has to be reading at the same time.
_INLINE_SEND_BYTES = 32 * 1024


def as_bytes(view: np.ndarray) -> memoryview:
    """A flat byte memoryview of a contiguous array (works for bfloat16 too)."""
    return memoryview(view.view(np.uint8).reshape(-1))


class Link(abc.ABC):
    """One rank's connection to one peer.

    Sends and receives on one link happen in the same order on both sides, so
    messages need no tags; a size header catches any disagreement.

    Attributes:
        peer: The other rank.
        sock: The socket to it (shared memory sends its notices there); shutting it
            down wakes any wait on the link.
    """

    peer: int
    sock: socket.socket

    @abc.abstractmethod
    def send(self, views: Sequence[np.ndarray]) -> None:
        """Start sending the bytes of ``views``; may return before they are sent."""

    @abc.abstractmethod
    def wait_sent(self) -> None:
        """Block until every started send has completed (or raise its error)."""

    @abc.abstractmethod
    def recv_into(self, views: Sequence[np.ndarray]) -> None:
        """Receive exactly ``nbytes_of(views)`` bytes into the views."""

    @abc.abstractmethod
    def recv_reduce(self, views: Sequence[np.ndarray], op: ops.ReduceOp,
                    bases: Sequence[np.ndarray] | None = None) -> None:
        """Receive values of the views' dtype and reduce them into the views.

        With ``bases`` (arrays parallel to ``views``), ``view = op(base, incoming)``: an
        out-of-place allreduce reads the caller's input there instead of a copy of it.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the link; a blocked peer sees the connection drop."""


def check_header(kind: int, nbytes: int, want_kind: int, want_bytes: int, peer: int) -> None:
    """Raise CollectiveError when a peer's message is not the one the protocol expects."""
    if kind != want_kind or nbytes != want_bytes:
        raise CollectiveError(
            f"protocol error with rank {peer}: expected message kind {want_kind} of "
            f"{want_bytes} bytes, got kind {kind} of {nbytes} bytes "
            "(ranks disagree on an operation)"
        )


class TcpLink(Link):
    """A link over an authenticated TCP socket.

    Args:
        sock: Connected, authenticated socket; its timeout is every wait's deadline.
        peer: The peer's rank.
    """

    def __init__(self, sock: socket.socket, peer: int) -> None:
        self.sock = sock
        self.peer = peer
        self._what = f"rank {peer}"
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._outstanding = 0
        self._sender: threading.Thread | None = None
        self._scratch = np.empty(0, np.uint8)

    def send(self, views: Sequence[np.ndarray]) -> None:
        nbytes = nbytes_of(views)
        header = HEADER.pack(KIND_DATA, nbytes)
        if nbytes <= _INLINE_SEND_BYTES and self._outstanding == 0:
            payload = b"".join([header, *(as_bytes(v) for v in views)])
            wire.send_all(self.sock, payload, self._what)
            return
        if self._sender is None:
            self._sender = threading.Thread(
                target=self._send_loop, name=f"hvd-send-{self.peer}", daemon=True
            )
            self._sender.start()
        self._outstanding += 1
        self._jobs.put((header, list(views)))

    def _send_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            header, views = job
            try:
                wire.send_all(self.sock, header, self._what)
                for view in views:
                    wire.send_all(self.sock, as_bytes(view), self._what)
                self._done.put(None)
            except BaseException as exc:  # noqa: BLE001 - re-raised in wait_sent
                self._done.put(exc)

    def idle(self) -> bool:
        """True when no send is waiting in the sender thread."""
        return self._outstanding == 0

    def scratch(self, nbytes: int) -> np.ndarray:
        """This link's receive scratch, at least ``nbytes`` (its first ``nbytes``)."""
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch[:nbytes]

    def wait_sent(self) -> None:
        timeout = self.sock.gettimeout()
        while self._outstanding:
            try:
                result = self._done.get(timeout=timeout)
            except queue.Empty:
                raise CollectiveTimeoutError(
                    f"sending to rank {self.peer} did not finish within {timeout} s"
                ) from None
            self._outstanding -= 1
            if result is not None:
                self._outstanding = 0
                raise result

    def _recv_header(self, nbytes: int) -> None:
        kind, got = HEADER.unpack(wire.recv_exact(self.sock, HEADER.size, self._what))
        check_header(kind, got, KIND_DATA, nbytes, self.peer)

    def recv_into(self, views: Sequence[np.ndarray]) -> None:
        self._recv_header(nbytes_of(views))
        for view in views:
            wire.recv_into_exact(self.sock, as_bytes(view), self._what)

    def recv_reduce(self, views: Sequence[np.ndarray], op: ops.ReduceOp,
                    bases: Sequence[np.ndarray] | None = None) -> None:
        nbytes = nbytes_of(views)
        self._recv_header(nbytes)
        scratch = self.scratch(nbytes)
        wire.recv_into_exact(self.sock, memoryview(scratch), self._what)
        offset = 0
        for i, view in enumerate(views):
            incoming = scratch[offset : offset + view.nbytes].view(view.dtype)
            ops.reduce_into(view, incoming, op, None if bases is None else bases[i])
            offset += view.nbytes

    def close(self) -> None:
        if self._sender is not None:
            self._jobs.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
