"""The TCP engine's control sockets: holding requests for a peer, sending them without
ever blocking the cycle, the wake socket, receiving, and the goodbye at shutdown.

Each rank has a control socket to rank 0 (rank 0: one to every other rank). The thread
running the cycle sends here on both ranks of a pair, so a send never waits for room:
what a socket does not take at once goes to a thread of its own (``_drain_backlog``).
Submissions are held per peer (``hold``) and leave together at the next cycle, a burst
in one frame. The engine owns one ``ControlChannel``; the channel knows nothing of the
engine but two callbacks (its failure, and how to record one).
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections.abc import Callable

from hvd_spark.collectives import messages as m
from hvd_spark.collectives.tcp import readiness, wire
from hvd_spark.errors import HvdSparkError, PeerDisconnectedError

log = logging.getLogger(__name__)

# How long a leaving rank waits for the others' goodbyes (and its backlog to go out).
_BYE_WAIT_S = 10.0
# Control messages that carry requests, held per peer (``_hold``) and sent as tuples.
_REQUEST_KINDS = ("req", "pair")
# How long rank 0 tries to tell a peer why it stops, before closing tells it anyway.
_ABORT_SEND_S = 1.0


def disconnected(peer: int, rank: int) -> PeerDisconnectedError:
    """The error for ``peer``'s control socket closing under ``rank``."""
    return PeerDisconnectedError(
        f"rank {peer} disconnected (it exited or was killed) while rank {rank} "
        f"was still running; see rank {peer}'s log for its error")


def messages_of(kind: str, payload: object) -> tuple[str, object]:
    """A control message as read off the wire, with its requests or responses rebuilt:
    they travel as tuples (see ``Request.fields``)."""
    if kind in _REQUEST_KINDS:
        payload = [m.Request.from_fields(fields) for fields in payload]
    elif kind == "resp":
        payload = [m.Response.from_fields(fields) for fields in payload]
    return kind, payload


class ControlChannel:
    """One rank's control sockets, the frames held for them, and the wake socket.

    Args:
        rank, size: This rank and the world size.
        control: Control sockets (rank 0: one per other rank; others: ``{0: sock}``).
        failure: The engine's failure so far (None while it runs): a peer whose backlog
            sender stopped gets nothing more, and leaving stops waiting, once it is set.
        record_failure: Records a failure to send (from a backlog's sender thread); the
            channel then wakes the cycle, which fails what is pending.

    Attributes:
        socks: Peer rank -> control socket.
        send_lock: Held around ``hold`` and ``send`` (by callers' threads and the cycle),
            so frames leave a socket in the order they were held.
        outbox: Requests held per peer, as (kind, requests), until the next ``send``.
        draining: Peers whose backlog a thread is sending (nothing goes out ahead of it).
        wake_r: The socket a ``wake`` makes readable (the cycle watches it).
        peer_by_fd: A control socket's file descriptor -> the rank at its other end.
        bye_from: Peers that said goodbye.
        frames_sent: Control frames sent (a burst of submissions shares one).
    """

    def __init__(self, rank: int, size: int, control: dict[int, socket.socket],
                 failure: Callable[[], BaseException | None],
                 record_failure: Callable[[BaseException], None]) -> None:
        self.rank, self.size = rank, size
        self.socks = dict(control)
        self._failure = failure
        self._record_failure = record_failure
        self.peer_by_fd = {s.fileno(): r for r, s in self.socks.items()}
        self.frames_sent = 0
        self.send_lock = threading.Lock()
        # Submissions are held here (under send_lock) and leave together at the next
        # cycle, a burst in one frame; anything else sent to that peer goes after.
        self.outbox: dict[int, list[tuple[str, list[m.Request]]]] = {
            peer: [] for peer in self.socks}
        self._wake_pending = False  # a wake byte is on its way (one per cycle is enough)
        # Bytes for a peer that its socket did not take at once, in order (under
        # send_lock), and the peers whose backlog a thread is sending (see send).
        self._backlog: dict[int, collections.deque[list[memoryview]]] = {
            peer: collections.deque() for peer in self.socks}
        self.draining: set[int] = set()
        self.wake_r, self._wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.bye_from: set[int] = set()
        self._told_others = False

    # ------------------------------------------------------------------ sending

    def hold(self, peer: int, kind: str, requests: list[m.Request]) -> None:
        """Hold ``requests`` for ``peer``, in one frame with those held before them (the
        caller holds the send lock)."""
        box = self.outbox[peer]
        if box and box[-1][0] == kind:
            box[-1][1].extend(requests)
        else:
            box.append((kind, list(requests)))

    def send(self, peer: int, frames: list) -> None:
        """Send what is held for ``peer``, then ``frames`` (the caller holds the send
        lock). A failure fails the engine, and with it every pending operation.

        The thread running the cycle sends here, on both ranks of a pair, so it must not
        wait for room on the socket: the other rank's cycle may be waiting to send too,
        and neither would read. What the socket does not take at once goes to a thread
        that waits for it (``_drain_backlog``), and what follows queues behind it.
        """
        held = self.outbox[peer]
        if held:
            # Pickled now: a snapshot of the tensors riding along, taken before any
            # reduction into them (pairs are decided only after this, see Pairing.decide).
            frames = [*(wire.encode_obj((kind, [r.fields() for r in requests]), pooled=True)
                        for kind, requests in held), *frames]
            held.clear()
        if not frames:
            return
        if peer in self.draining and self._failure() is not None:
            return  # its sender stopped on that failure: nothing more leaves
        self.frames_sent += len(frames)
        pieces = wire.frame_pieces(frames)
        if peer not in self.draining:
            pieces = wire.send_pieces_now(self.socks[peer], pieces, f"rank {peer}")
            if not pieces:
                return
            self.draining.add(peer)
            threading.Thread(target=self._drain_backlog, args=(peer,), daemon=True,
                             name=f"hvd-send-{peer}").start()
        self._backlog[peer].append(pieces)

    def _drain_backlog(self, peer: int) -> None:
        """Send ``peer``'s backlog in order, waiting for room (up to the socket's
        timeout); a failure fails the engine, as in ``send``."""
        sock, what = self.socks[peer], f"rank {peer}"
        while True:
            with self.send_lock:
                if not self._backlog[peer]:
                    self.draining.discard(peer)
                    return
                pieces = self._backlog[peer].popleft()
            try:
                wire.send_pieces(sock, pieces, what)
            except BaseException as exc:  # noqa: BLE001 - any error fails the engine
                if not isinstance(exc, HvdSparkError):
                    exc = PeerDisconnectedError(f"sending to {what} failed: {exc!r}")
                self._record_failure(exc)
                with self.send_lock:
                    self._backlog[peer].clear()
                self.wake()  # the cycle fails what is pending
                return  # (still "draining": nothing more goes out on that socket)

    def flush(self) -> None:
        """Send every held frame (the cycle calls this)."""
        if any(self.outbox.values()):
            with self.send_lock:
                for peer in self.outbox:
                    self.send(peer, [])

    def broadcast(self, frame: bytes | bytearray | memoryview) -> None:
        """Send ``frame`` to every peer, after what is held for each."""
        with self.send_lock:  # callers' threads hold pair copies for these sockets too
            for peer in self.socks:
                self.send(peer, [frame])

    def wake(self) -> None:
        """Make ``wake_r`` readable, unless a wake is on its way already."""
        if self._wake_pending:
            return  # the thread has yet to read the last one: it will look anyway
        self._wake_pending = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def drain_wake(self) -> None:
        """Read the wake bytes (the cycle saw ``wake_r`` readable)."""
        try:
            while self.wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        # Cleared after draining (a byte sent meanwhile would be eaten with the flag
        # still set, and no wake would ever be sent again) and before the caller looks
        # for work: a submitter that still saw it set had queued or held its work
        # already, so the cycle that follows takes that work.
        self._wake_pending = False

    # ------------------------------------------------------------------ receiving

    def recv(self, peer: int, sock: socket.socket) -> tuple[str, object]:
        """The next control message from ``peer``: (kind, payload).

        Raises:
            PeerDisconnectedError: ``peer`` closed its control socket.
        """
        try:
            kind, payload = wire.recv_obj(sock, f"rank {peer}", pooled=True)
        except PeerDisconnectedError:
            raise disconnected(peer, self.rank) from None
        return messages_of(kind, payload)

    def tell_others(self, failure: BaseException | None) -> None:
        """Pass the reason this rank stops to its control peers before closing (rank 0:
        every rank; the others: rank 0, which passes it on), so that every survivor
        fails with the root cause ("rank 2 sent no heartbeat ...") instead of "rank 1
        disconnected" when that rank stopped on the news first."""
        if not isinstance(failure, PeerDisconnectedError):
            return
        reason = getattr(failure, "root_reason", None) or str(failure)
        told_by = getattr(failure, "told_by", None)  # it knows already
        with self.send_lock:
            if self._told_others:
                return
            self._told_others = True
            for peer, sock in self.socks.items():
                if peer == told_by or peer in self.draining:
                    continue  # (a frame half sent there: closing tells it)
                try:
                    sock.settimeout(_ABORT_SEND_S)
                    wire.send_obj(sock, ("abort", reason), f"rank {peer}")
                except (HvdSparkError, OSError):
                    pass  # that peer is gone too, or stuck: closing tells it anyway

    # ------------------------------------------------------------------ leaving

    def leave(self) -> None:
        """Graceful exit: everyone says bye to rank 0, which releases all once all did."""
        if self.size == 1:
            return
        try:
            if self.rank != 0:
                with self.send_lock:
                    self.send(0, [wire.encode_obj(("bye", None))])
                self._wait_for(lambda: 0 in self.bye_from)
            else:
                self._wait_for(lambda: len(self.bye_from) == self.size - 1)
                self.broadcast(wire.encode_obj(("bye", None)))
            # A backlog's sender may still hold the goodbye: let it go before closing.
            deadline = time.monotonic() + _BYE_WAIT_S
            while (self.draining and self._failure() is None
                   and time.monotonic() < deadline):
                time.sleep(1e-3)
        except HvdSparkError as exc:
            log.debug("rank %d left without a clean goodbye: %s", self.rank, exc)

    def _wait_for(self, condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + _BYE_WAIT_S
        while not condition():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            readable = readiness.wait_readable(list(self.socks.values()), left)
            for sock in readable:
                peer = self.peer_by_fd[sock.fileno()]
                kind, _ = wire.recv_obj(sock, f"rank {peer}")
                if kind == "bye":
                    self.bye_from.add(peer)

    def shut_down(self) -> None:
        """Shut the control sockets down (safe from any thread, while others use them):
        every wait on them returns."""
        for sock in self.socks.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Close the control and wake sockets: every peer blocked on us fails at once."""
        # Shut down first: a close() alone sends nothing while a thread still waits in a
        # send on it (a backlog's sender, see send).
        self.shut_down()
        for sock in [*self.socks.values(), self.wake_r, self._wake_w]:
            try:
                sock.close()
            except OSError:
                pass
