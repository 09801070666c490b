"""The TCP backend's engine: negotiation through rank 0 over control sockets.

Callers enqueue named requests and get handles. Rank 0's engine coordinates: the
others send it their requests over their control sockets; once every rank asked
for a name (and they agree), it sends the same ordered response list to all, and
every rank runs it on the backend. So ranks may issue operations in any order,
and a disagreement becomes an error on every rank instead of a hang.

With two ranks, small allreduces skip rank 0's decision: each rank sends the other its
request and both decide alone (see ``pairing``).

The cycle runs on the background thread, or on a caller's thread while it waits
(``EngineCore.wait``); the background thread parks meanwhile, so the two never
race for a control socket's messages.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time

import numpy as np

from hvd_spark.collectives import messages as m
from hvd_spark.collectives import timeline
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.coordinator import Coordinator
from hvd_spark.collectives.engine_core import DRIVE_SLICE_S, PARK_S, EngineCore, timeline_row
from hvd_spark.collectives.operations import Entry, Handle
from hvd_spark.collectives.ops import SUPPORTED_DTYPES, ReduceOp, check_reduction, reduce_rows
from hvd_spark.collectives.pairing import PairTable, disagreement, pairable
from hvd_spark.collectives.tcp import wire
from hvd_spark.config import EngineConfig
from hvd_spark.errors import (
    CollectiveError,
    HvdSparkError,
    PeerDisconnectedError,
)

log = logging.getLogger(__name__)

_IDLE_POLL_S = 1.0
_BYE_WAIT_S = 10.0
_ABORT_SEND_S = 1.0
# Rank 0's background thread, woken by a local submission, first gives the submitting
# thread this long to come and wait (a synchronous call does at once): then that thread
# runs the operation itself, instead of receiving the result across threads.
_GRACE_S = 200e-6
# How often rank 0 looks for paired requests waiting too long (stall warning, timeout).
_PAIR_CHECK_S = 0.1
# Most control frames read from one peer in one cycle: all that wait (requests, pair
# copies and responses queue up while a ring runs), so they are decided and fused
# together, but never without end.
_FRAMES_PER_CYCLE = 256


class Engine(EngineCore):
    """Runs one rank's collectives: a background thread, or the waiting caller.

    Args:
        rank, size: This rank and the world size.
        comm: The backend that moves the bytes.
        control: Control sockets (rank 0: one per other rank; others: ``{0: sock}``).
        config: Fusion, cycle and timeout settings.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        comm: Communicator,
        control: dict[int, socket.socket],
        config: EngineConfig,
    ) -> None:
        super().__init__(rank, size, comm, config)
        self._control = dict(control)
        self._sock_rank = {s.fileno(): r for r, s in self._control.items()}
        self._coordinator = (Coordinator(size, config.fusion_threshold, self.eager_bytes,
                                         self.lone_eager_bytes)
                             if rank == 0 else None)
        self._start_autotune(self._coordinator)
        # Two ranks decide their small allreduces alone (see ``pairing``); under _lock.
        self._pairs = PairTable() if size == 2 else None
        self._pair_warned: set[str] = set()
        self._next_pair_check = 0.0
        #: Allreduces the two ranks decided alone (see ``pairing``).
        self.paired = 0
        #: Control frames this rank sent (a burst of submissions shares one).
        self.frames_sent = 0
        self._send_lock = threading.Lock()
        # Requests waiting to go to each peer (under _send_lock): submissions are held
        # here as (kind, requests) and leave together at the next cycle, a burst in one
        # frame (see ``_submitted``); anything else sent to that peer goes after them.
        self._outbox: dict[int, list[tuple[str, list[m.Request]]]] = {
            peer: [] for peer in self._control}
        self._wake_pending = False  # a wake byte is on its way (one per cycle is enough)
        # Bytes for a peer that its socket did not take at once, in order (under
        # _send_lock), and the peers whose backlog a thread is sending (see _send).
        self._backlog: dict[int, collections.deque[list[memoryview]]] = {
            peer: collections.deque() for peer in self._control}
        self._draining: set[int] = set()
        # A caller waiting for its operation polls this long before sleeping in select
        # (init() resolves the setting against the ranks on this host).
        self._spin_s = config.spin_seconds(size)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._bye_from: set[int] = set()
        self._first_ready: float | None = None
        self._told_others = False
        self._watching = False  # the background thread selects on the control sockets
        self._parked = False  # the background thread stands aside for driving callers
        #: Synchronous allreduces ``express_allreduce`` ran alone, and those it handed to
        #: the usual path after sending (something else turned up).
        self.express_rounds = 0
        self.express_fallbacks = 0
        self._coordinated_at = 0.0  # rank 0: when the cycle last coordinated
        self._thread = threading.Thread(target=self._run, name="hvd-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side

    def _queues_locally(self) -> bool:
        return False  # rank 0 queues in _submitted, after taking out what it pairs

    def _submitted(self, entries: list[Entry]) -> None:
        """Record the requests and hold them for the next cycle, which sends what the
        caller submitted meanwhile in the same frame: a burst of asynchronous allreduces
        (161 gradients) leaves in a frame or two, not 161, each of which cost the sender
        50-70 us to wake the peer on a VM and the receiver tens of microseconds to read.
        A synchronous caller runs that cycle at once.
        """
        if self._coordinator is None:
            self._submit_to_rank_0(entries)
        else:
            self._submit_on_rank_0(entries)
        if not self._parked or self._drivers:
            # Parked, it looks again within PARK_S unless a caller drives first; not
            # waking it spares a synchronous call a GIL hand-off. A caller that drives
            # already (another thread) is woken to send these.
            self._wake()

    def _submit_to_rank_0(self, entries: list[Entry]) -> None:
        """Hold the requests for rank 0; a response wakes the background thread, or a
        waiting caller reads it.

        With two ranks, the pairable ones are recorded too (see ``pairing``): recorded
        before they leave, since rank 0's answer may follow; in the same hold of the
        lock as they are held, so a pair decided here (matched under that lock) finds
        them held or sent (``_decide`` pickles them before reducing into the tensors
        that ride along); and in order, under the send lock, or a request of a name's
        next round could reach rank 0 before this one.
        """
        requests = [e.request for e in entries]
        with self._send_lock:  # requests leave in the order they were recorded
            with self._lock:
                if self._pairs is not None:
                    self._record_own([r for r in requests if pairable(r)])
                self._hold(0, "req", requests)

    def _submit_on_rank_0(self, entries: list[Entry]) -> None:
        """Queue the requests for the coordinator, but for those the two ranks decide
        alone: a copy of those is held for rank 1.

        The copy is held under the send lock taken before the requests are recorded, so
        no response for them (sent under the same lock, after what is held) can
        overtake it on the wire.
        """
        rest = entries
        if self._pairs is not None:
            with self._send_lock:
                with self._lock:
                    pairing, unpaired = self._pairing_open(), self._pairs.unpaired
                    paired, rest = [], []
                    for entry in entries:
                        request = entry.request
                        if pairing and pairable(request) and request.name not in unpaired:
                            paired.append(entry)
                        else:
                            rest.append(entry)
                    if paired:
                        requests = [e.request for e in paired]
                        self._record_own(requests)
                        self._hold(1, "pair", requests)  # (as in _submit_to_rank_0)
        if rest:
            with self._lock:
                self._queue.extend(rest)

    def express_allreduce(self, name: str, array: np.ndarray, op: int, postscale: float,
                          inplace: bool) -> np.ndarray | None:
        """A synchronous allreduce the two ranks decide alone (see ``pairing``), with
        nothing else going on: this thread sends its request, reads the other rank's and
        reduces both, with no entry, handle or cycle (a 1 KB call: 79 us against 132 on the
        usual path here).

        On the wire it is the usual path's exchange (a pair copy from rank 0, a request
        from rank 1), so a peer on either path agrees with it. Whenever something else
        turns up (another frame, another thread's submission, a slow peer), this rank
        takes up the state the usual path would have had since the submission and the
        usual cycle goes on from there (``_express_fallback``).

        Returns:
            The result (``array`` itself when ``inplace``), or None when this call does
            not qualify (the caller then submits it as usual, under the same name).
        """
        if (self._pairs is None or not array.flags.c_contiguous
                or array.nbytes > self.lone_eager_bytes or array.dtype not in SUPPORTED_DTYPES
                or (inplace and not array.flags.writeable)):
            return None
        try:  # as the usual path reads them; it names what is wrong, too
            op, postscale = ReduceOp(op), float(postscale)
            check_reduction(array.dtype, op, 1.0, postscale, name)
        except (TypeError, ValueError, HvdSparkError):
            return None
        if op == ReduceOp.Adasum or not self._progress.acquire(blocking=False):
            return None
        try:
            request = m.Request(name, m.ALLREDUCE, m.dtype_name(array.dtype), array.shape,
                                int(op), 1.0, postscale, payload=array.reshape(-1))
            claimed, held = self._express_claim(request)
            if not claimed:
                return None
            try:
                result, entry = self._express_run(request, op, array, inplace, held)
            finally:
                with self._lock:
                    self._drivers -= 1
                    self._driver_left_at = time.monotonic()
        finally:
            self._progress.release()
        return result if entry is None else self.wait(entry.handle)

    def _express_run(self, request: m.Request, op: ReduceOp, array: np.ndarray,
                     inplace: bool, held: m.Request | None,
                     ) -> tuple[np.ndarray | None, Entry | None]:
        """Send ``request``, take the other rank's and reduce: (result, None); or, when
        the usual path must go on, (None, the entry it waits for)."""
        name = request.name
        try:
            # A small result goes to a numpy caller: no pool, no alignment (the TensorFlow
            # binding aligns what it adopts itself).
            out = array if inplace else np.empty(array.shape, array.dtype)
            self._express_send(request)
            peer_request, frame = (held, None) if held else self._express_read(name)
            if peer_request is not None:
                first, second = ((request, peer_request) if self.rank == 0
                                 else (peer_request, request))
                if disagreement(name, first, second) is None:
                    reduce_rows([first.payload, second.payload], op, request.postscale,
                                out=out.reshape(-1))
                    self.paired += 1
                    self.express_rounds += 1
                    self.executed_responses += 1
                    self.executed_tensors += 1
                    self.executed_eager += 1
                    with self._lock:
                        self._names_in_flight.discard(name)
                    return out, None
            self.express_fallbacks += 1
            return None, self._express_fallback(request, array, out, peer_request, frame)
        except BaseException as exc:  # noqa: BLE001 - as a waiting caller's _drive
            # (An entry the fallback made pending is failed with every other one.)
            self._fail(exc)
            self._failed_while_driving()
            with self._lock:
                self._names_in_flight.discard(name)
            raise self._error_for(name) from exc

    def _express_claim(self, request: m.Request) -> tuple[bool, m.Request | None]:
        """Claim ``request``'s name when this rank has nothing else in flight and would
        pair it (as ``_submit_on_rank_0`` decides); also the other rank's request of it,
        when a cycle read that already."""
        pairs, name = self._pairs, request.name
        with self._lock:
            if (self._failure is not None or self._stopping or self._pending
                    or self._queue or any(self._outbox.values()) or self._draining
                    or pairs.own or any(n != name for n in pairs.peer)
                    or name in self._names_in_flight):
                return False, None
            coord = self._coordinator
            if coord is not None and (
                    not self._pairing_open() or name in pairs.unpaired
                    or coord.waiting_for(name) or coord.has_ready()
                    or (coord.has_partial()
                        and time.monotonic() - self._coordinated_at > _PAIR_CHECK_S)):
                # A decision due now is the cycle's to send; and requests waiting for
                # this rank need the cycle's stall warnings and timeout now and then
                # (a loop of express calls would otherwise keep it from ever running).
                return False, None
            self._names_in_flight.add(name)
            # A driver meanwhile: a submission from another thread wakes this one (which
            # then leaves the rest to the cycle), and the background thread stays parked.
            self._drivers += 1
            held = pairs.peer.pop(name, None)
            self._pair_warned.discard(name)  # as _decide does for a pair it runs
        return True, None if held is None else held[0]

    def _express_send(self, request: m.Request) -> None:
        """Send this rank's request to the other rank, as the usual path's cycle would
        (pickled now: before any reduction into the tensor riding along)."""
        peer = 1 - self.rank
        with self._send_lock:
            with self._lock:
                self._hold(peer, "pair" if self._coordinator is not None else "req", [request])
            self._send(peer, [])

    def _express_read(self, name: str) -> tuple[m.Request | None, tuple | None]:
        """The other rank's request of ``name``, when its next frame is just that and
        comes within a slice; else None, with the frame read, if one was: (request, frame).
        """
        peer = 1 - self.rank
        sock = self._control[peer]
        watched = [sock, self._wake_r]
        left = DRIVE_SLICE_S
        readable = (wire.poll_readable(watched, min(self._spin_s, left))
                    or wire.wait_readable(watched, left))
        if sock not in readable or self._wake_r in readable:
            return None, None  # too slow, or another thread's work: the cycle sends it
        kind, payload = self._recv_control(peer, sock)
        expected = "req" if self._coordinator is not None else "pair"
        if (kind == expected and len(payload) == 1 and payload[0].name == name
                and pairable(payload[0])):
            return payload[0], None
        return None, (kind, payload)

    def _express_fallback(self, request: m.Request, array: np.ndarray, out: np.ndarray,
                          peer_request: m.Request | None, frame: tuple | None) -> Entry:
        """Take up the usual path's state for ``request``: its entry pending and its
        request recorded as paired (as at submission), the other rank's request or the
        frame read meanwhile handled as a cycle would; the usual wait goes on from there."""
        # Out of place, the backend reads the caller's input (a joined rank's round runs
        # the allreduce there, not from the payloads).
        entry = Entry(request, Handle(request.name), out,
                      source=None if out is array else array)
        now = time.monotonic()
        with self._lock:
            self._pending[request.name] = entry
            self._pairs.own[request.name] = (request, now)
        if peer_request is not None:
            self._on_message(1 - self.rank, "req" if self._coordinator is not None
                             else "pair", [peer_request])
        elif frame is not None:
            self._on_message(1 - self.rank, *frame)
        self._run_pairs()
        return entry

    def _record_own(self, requests: list[m.Request]) -> None:
        """Record this rank's paired ``requests`` (the caller holds the lock)."""
        now, own = time.monotonic(), self._pairs.own
        for request in requests:
            own[request.name] = (request, now)

    def _hold(self, peer: int, kind: str, requests: list[m.Request]) -> None:
        """Hold ``requests`` for ``peer``, in one frame with those held before them (the
        caller holds the send lock and the lock)."""
        box = self._outbox[peer]
        if box and box[-1][0] == kind:
            box[-1][1].extend(requests)
        else:
            box.append((kind, list(requests)))

    def _send(self, peer: int, frames: list) -> None:
        """Send what is held for ``peer``, then ``frames`` (the caller holds the send
        lock). A failure fails the engine, and with it every pending operation.

        The thread running the cycle sends here, on both ranks of a pair, so it must not
        wait for room on the socket: the other rank's cycle may be waiting to send too,
        and neither would read. What the socket does not take at once goes to a thread
        that waits for it (``_drain_backlog``), and what follows queues behind it.
        """
        held = self._outbox[peer]
        if held:
            # Pickled now: a snapshot of the tensors riding along, taken before any
            # reduction into them (pairs are decided only after this, see _decide).
            frames = [*(wire.encode_obj(item, pooled=True) for item in held), *frames]
            held.clear()
        if not frames:
            return
        if peer in self._draining and self._failure is not None:
            return  # its sender stopped on that failure: nothing more leaves
        self.frames_sent += len(frames)
        pieces = wire.frame_pieces(frames)
        if peer not in self._draining:
            pieces = wire.send_pieces_now(self._control[peer], pieces, f"rank {peer}")
            if not pieces:
                return
            self._draining.add(peer)
            threading.Thread(target=self._drain_backlog, args=(peer,), daemon=True,
                             name=f"hvd-send-{peer}").start()
        self._backlog[peer].append(pieces)

    def _drain_backlog(self, peer: int) -> None:
        """Send ``peer``'s backlog in order, waiting for room (up to the socket's
        timeout); a failure fails the engine, as in ``_send``."""
        sock, what = self._control[peer], f"rank {peer}"
        while True:
            with self._send_lock:
                if not self._backlog[peer]:
                    self._draining.discard(peer)
                    return
                pieces = self._backlog[peer].popleft()
            try:
                wire.send_pieces(sock, pieces, what)
            except BaseException as exc:  # noqa: BLE001 - any error fails the engine
                if not isinstance(exc, HvdSparkError):
                    exc = PeerDisconnectedError(f"sending to {what} failed: {exc!r}")
                with self._lock:
                    if self._failure is None:
                        self._failure = exc
                with self._send_lock:
                    self._backlog[peer].clear()
                self._wake()  # the background thread fails what is pending
                return  # (still "draining": nothing more goes out on that socket)

    def _flush(self) -> None:
        """Send every held frame (the cycle calls this)."""
        if any(self._outbox.values()):
            with self._send_lock:
                for peer in self._outbox:
                    self._send(peer, [])

    def _driver_arrived(self) -> None:
        if self._watching:
            self._wake()  # it must leave the control sockets to this caller

    def _drive(self, timeout: float) -> None:
        self._cycle(timeout, spin=self._spin_s)

    def _failed_while_driving(self) -> None:
        self._tell_others(self._failure)
        self._wake()  # the background thread sees the failure and closes

    def shutdown(self) -> None:
        """Leave the job gracefully: tell the coordinator, wait for all ranks, close."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._wake()
        self._thread.join(self.config.timeout)

    def abort(self, error: HvdSparkError) -> None:
        """Fail this rank's collectives now with ``error`` (from any thread).

        Used when the launcher reports a lost peer: operations blocked on it fail at once
        with that reason instead of waiting for the collective timeout.
        """
        with self._lock:
            if self._failure is None:
                self._failure = error
        for sock in self._control.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.comm.abort()
        self._wake()

    def _wake(self) -> None:
        if self._wake_pending:
            return  # the thread has yet to read the last one: it will look anyway
        self._wake_pending = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # ------------------------------------------------------------------ background thread

    def _run(self) -> None:
        try:
            while True:
                if self._drivers and self._failure is None and not self._stopping:
                    self._park()
                    continue
                with self._progress:
                    if self._failure is not None:
                        raise self._failure
                    if self._stopping and not self._queue and not self._drivers:
                        self._leave()
                        return
                    self._cycle(0.0)
                    timeout = self._next_timeout()
                self._watch(timeout)
        except BaseException as exc:  # noqa: BLE001 - every error fails the pending handles
            self._fail(exc)
            self._tell_others(self._failure)
        finally:
            with self._progress:
                self._close()

    def _park(self) -> None:
        """Stand aside while callers drive (see ``_callers_drive``); then look for work.

        It sleeps rather than waiting on the wake socket: a wake meant for the caller
        that drives (another thread's submission, held for its cycle to send) would be
        read here, and that caller would sleep on in its cycle for up to a slice.
        """
        self._parked = True
        try:
            while not self._failure and not self._stopping and self._callers_drive():
                time.sleep(PARK_S)
        finally:
            self._parked = False

    def _watch(self, timeout: float) -> None:
        """Wait for messages or submissions, unless a caller is about to drive."""
        self._watching = True
        try:
            if self._drivers:
                return  # it came meanwhile (it saw _watching unset, or will wake us)
            readable = wire.wait_readable([self._wake_r, *self._control.values()], timeout)
            if (readable == [self._wake_r] and (self._queue or any(self._outbox.values()))
                    and not self._drivers):
                time.sleep(_GRACE_S)  # then park if the submitter came to drive
        finally:
            self._watching = False

    def _next_timeout(self) -> float:
        if self._coordinator is not None and self._coordinator.has_ready():
            return self._cycle_remaining()
        return _IDLE_POLL_S

    def _tell_others(self, failure: BaseException | None) -> None:
        """Rank 0: pass the reason it stopped to every rank before closing, so they fail
        with the root cause ("rank 1 disconnected") instead of "rank 0 disconnected"."""
        if (self._coordinator is None or self._told_others
                or not isinstance(failure, PeerDisconnectedError)):
            return
        self._told_others = True
        for peer, sock in self._control.items():
            try:
                with self._send_lock:
                    if peer in self._draining:
                        continue  # a frame is half sent there: closing tells it
                    sock.settimeout(_ABORT_SEND_S)
                    wire.send_obj(sock, ("abort", str(failure)), f"rank {peer}")
            except (HvdSparkError, OSError):
                pass  # that peer is gone too, or stuck: closing tells it anyway

    def _cycle(self, max_wait: float, spin: float = 0.0) -> None:
        """Wait up to ``max_wait`` s for messages, then handle all that arrived.

        With ``spin`` (a caller waiting for its result), poll that long before sleeping:
        a small operation's answer usually comes within it, and waking from a sleep costs
        more than the whole operation does on a VM.
        """
        decided = self._run_pairs()
        self._flush()  # before blocking: the answers to these are what it waits for
        timeout = 0.0 if self._queue or decided else min(max_wait, self._next_timeout())
        watched = [self._wake_r, *self._control.values()]
        readable = wire.poll_readable(watched, min(spin, timeout))
        if not readable:
            readable = wire.wait_readable(watched, timeout)
        new = self._drain_local(self._wake_r in readable)
        self._flush()  # what was submitted until the wake was read (see _drain_wake)
        tl = timeline.current() if self._coordinator is not None else None
        if tl is not None:
            tl.mark_cycle()
            for entry in new:
                tl.negotiate_start(timeline_row(entry.request.name, entry.request.kind),
                                   entry.request.kind)
        if self._coordinator is not None and new:
            self._add_own(new)
        for sock in readable:
            if sock is not self._wake_r:
                self._read_frames(sock)
        if self._pairs is not None:
            self._run_pairs()
        if self._coordinator is not None:
            self._coordinate()

    def _read_frames(self, sock: socket.socket) -> None:
        """Handle every control frame ``sock`` has waiting (up to ``_FRAMES_PER_CYCLE``).

        Several may wait (requests, pair copies, responses: they queue up while a ring
        runs). Read one a cycle, as before, a burst of 161 gradients took 161 cycles and
        rank 0 answered them in fused batches of a few as they trickled in; read
        together, they are decided (and fused) together.
        """
        peer = self._sock_rank[sock.fileno()]
        for _ in range(_FRAMES_PER_CYCLE):
            self._on_control(peer, sock)
            if self._failure is not None or not wire.wait_readable([sock], 0.0):
                return

    def _add_own(self, new: list[Entry]) -> None:
        """Rank 0: its own new requests for the coordinator (with rank 1's, if rank 1
        paired one that rank 0 could not)."""
        coord, pairs = self._coordinator, self._pairs
        now = time.monotonic()
        for entry in new:
            request = entry.request
            if pairs is not None:
                with self._lock:
                    held = pairs.peer.pop(request.name, None)
                    pairs.unpaired.discard(request.name)
                if held is not None:
                    coord.add(1, held[0], held[1])
            coord.add(0, request, now)

    def _pairing_open(self) -> bool:
        """Rank 0: whether new requests may be paired (the coordinator would add nothing)."""
        coord = self._coordinator
        return (not coord.joined and not coord.departed and self._tuner is None
                and timeline.current() is None and not self._stopping)

    def _add_peer(self, request: m.Request, now: float) -> None:
        """Rank 0: one of rank 1's requests, paired, held, or to the coordinator."""
        coord, pairs, name = self._coordinator, self._pairs, request.name
        self._match_previous(name)
        with self._lock:
            own = pairs.own.get(name)
            if pairable(request) and (own is not None or (
                    self._pairing_open() and not coord.waiting_for(name)
                    and name not in pairs.unpaired)):
                pairs.peer[name] = (request, now)  # decided now, or once rank 0 asks
                return
            if own is not None:  # rank 1's cannot be paired: neither can rank 0's
                del pairs.own[name]
            elif not coord.waiting_for(name):  # rank 0 has yet to ask: it must not pair
                pairs.unpaired.add(name)  # (_submit_on_rank_0 checks under this lock)
        if own is not None:
            coord.add(0, own[0], own[1])
        coord.add(1, request, now)

    def _hold_peer(self, request: m.Request, now: float) -> None:
        """Rank 1: record rank 0's copy of a paired request."""
        self._match_previous(request.name)
        with self._lock:
            self._pairs.peer[request.name] = (request, now)

    def _match_previous(self, name: str) -> None:
        """Before the other rank's next request of ``name`` is recorded, decide its
        previous one, still unmatched: it cannot replace that one.

        Its partner is recorded already (each rank records its own before it sends, and
        the other moves on to the next request of a name only once it has this rank's),
        unless the other rank broke the protocol.
        """
        pairs = self._pairs
        if name not in pairs.peer:
            return
        self._run_pairs()
        if name in pairs.peer:
            raise CollectiveError(
                f"rank {1 - self.rank} sent a second request of {name!r} before its first was "
                "answered; the ranks disagree on that collective's history")

    def _run_pairs(self) -> bool:
        """Decide and run every name both ranks have paired; True when one ran."""
        pairs = self._pairs
        if not pairs:
            return False
        with self._lock:
            matched = pairs.matched()
        self._decide(matched)
        return bool(matched)

    def _decide(self, matched: list[tuple[str, m.Request, m.Request]]) -> None:
        """Run each matched (name, own, peer) pair on this rank."""
        if matched:
            # This rank's requests may still be held, their tensors not yet pickled; the
            # reductions below write into those tensors.
            self._flush()
        for name, own, peer in matched:
            if self._pair_warned:
                self._pair_warned.discard(name)
            first, second = (own, peer) if self.rank == 0 else (peer, own)
            error = disagreement(name, first, second)
            if error is not None:
                self._execute(error)
            else:
                self._finish_pair(name, first, second)
            self.paired += 1

    def _finish_pair(self, name: str, first: m.Request, second: m.Request) -> None:
        """Reduce an agreed pair straight into this rank's entry and complete it."""
        with self._lock:
            entry = self._pending.pop(name, None)
        if entry is None:
            raise CollectiveError(f"rank {self.rank} paired {name!r}, which it never submitted")
        try:
            # Straight into this rank's output, which may be its own tensor's memory.
            reduce_rows([first.payload, second.payload], ReduceOp(first.op), first.postscale,
                        out=entry.array.reshape(-1))
            entry.source = None
            result = entry.finish(entry.array)
        except BaseException as exc:
            self._complete(entry, error=CollectiveError(
                f"collective {name!r} failed on rank {self.rank}: {exc!r}"))
            raise
        self.executed_responses += 1
        self.executed_tensors += 1
        self.executed_eager += 1
        self._complete(entry, result=result)

    def _release_pairs(self) -> None:
        """Rank 0, once a rank joined or left: what waits to be paired goes to the
        coordinator instead (rank 0's own only when rank 1 can no longer ask for them,
        or it might decide them alone while the coordinator does too)."""
        coord, pairs = self._coordinator, self._pairs
        with self._lock:
            # Complete pairs first, in the same hold: rank 1 may have both halves of
            # these (and decide them alone) even when it has joined since.
            matched = pairs.matched()
            peer = list(pairs.peer.values())
            pairs.unpaired.update(pairs.peer)  # rank 0 must not pair them if it asks later
            pairs.peer.clear()
            own = []
            if 1 in coord.joined or coord.departed:
                own = list(pairs.own.values())
                pairs.own.clear()
        self._decide(matched)
        for request, since in own:
            coord.add(0, request, since)
        for request, since in peer:
            coord.add(1, request, since)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        # Cleared after draining (a byte sent meanwhile would be eaten with the flag
        # still set, and no wake would ever be sent again) and before the caller looks
        # for work: a submitter that still saw it set had queued or held its work
        # already, so the cycle that follows takes that work.
        self._wake_pending = False

    def _drain_local(self, woken: bool) -> list[Entry]:
        if woken:
            self._drain_wake()
        if not self._queue:
            return []
        with self._lock:
            new = list(self._queue)
            self._queue.clear()
        return new

    def _on_control(self, peer: int, sock: socket.socket) -> None:
        self._on_message(peer, *self._recv_control(peer, sock))

    def _recv_control(self, peer: int, sock: socket.socket) -> tuple[str, object]:
        """The next control message from ``peer``: (kind, payload)."""
        try:
            return wire.recv_obj(sock, f"rank {peer}", pooled=True)
        except PeerDisconnectedError:
            raise PeerDisconnectedError(
                f"rank {peer} disconnected (it exited or was killed) while rank {self.rank} "
                f"was still running; see rank {peer}'s log for its error"
            ) from None

    def _on_message(self, peer: int, kind: str, payload) -> None:
        """Handle one control message from ``peer``."""
        what = f"rank {peer}"
        if kind == "req":
            now = time.monotonic()
            tl = timeline.current()
            for request in payload:
                if tl is not None:
                    row = timeline_row(request.name, request.kind)
                    tl.negotiate_start(row, request.kind)
                    tl.negotiate_rank_ready(row, peer)
                if self._pairs is not None:
                    self._add_peer(request, now)
                else:
                    self._coordinator.add(peer, request, now)
        elif kind == "pair":
            now = time.monotonic()
            for request in payload:
                self._hold_peer(request, now)
        elif kind == "resp":
            if self._pairs:
                self._run_pairs()  # quick, and their callers need not wait for the ring
            for response in payload:
                if self._pairs:
                    with self._lock:
                        self._pairs.drop(response.names)
                self._execute(response)
        elif kind == "abort":
            raise PeerDisconnectedError(f"{payload} (as rank 0 saw it)")
        elif kind == "bye":
            self._bye_from.add(peer)
            if self._coordinator is None:
                raise CollectiveError("rank 0 called shutdown(); no more collectives can run")
            self._coordinator.depart(peer, "called shutdown()")
        else:
            raise CollectiveError(f"unexpected control message {kind!r} from {what}")

    def _cycle_remaining(self) -> float:
        """Seconds to keep gathering before sending ready responses.

        A lone operation goes at once; only while other operations are half
        submitted does the coordinator linger (up to the cycle time) to fuse them.
        """
        if not self._coordinator.has_partial():
            return 0.0
        if self._first_ready is None:
            self._first_ready = time.monotonic()
        waited = time.monotonic() - self._first_ready
        return max(0.0, self.cycle_time_ms / 1000.0 - waited)

    def _coordinate(self) -> None:
        coord = self._coordinator
        now = self._coordinated_at = time.monotonic()
        for name, missing in coord.stalled(now, self.config.stall_warning):
            log.warning(
                "collective %r has waited over %.0f s for ranks %s; they may be stuck or call "
                "collectives with other names", name, self.config.stall_warning, missing)
        # HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: give up on a stalled tensor sooner than the timeout.
        limit = self.config.timeout
        if self.config.stall_shutdown > 0:
            limit = min(limit, self.config.stall_shutdown)
        if self._pairs:
            self._check_pairs(now, limit)
        coord.expire(now, limit)
        if not coord.has_ready() or self._cycle_remaining() > 0:
            return
        self._first_ready = None
        responses = coord.take_responses()
        self._taken(coord, responses)
        frame = wire.encode_obj(("resp", responses), pooled=True)  # once for every rank
        with self._send_lock:  # callers' threads hold pair copies for these sockets too
            for peer in self._control:
                self._send(peer, [frame])
        for response in responses:
            self._execute(response)

    def _check_pairs(self, now: float, limit: float) -> None:
        """Rank 0: stall warnings and the timeout for requests waiting to be paired."""
        coord, pairs = self._coordinator, self._pairs
        if coord.joined or coord.departed:
            self._release_pairs()
        if now < self._next_pair_check:
            return
        self._next_pair_check = now + _PAIR_CHECK_S
        oldest = pairs.oldest()
        # Nothing to warn about or to fail yet (the timeout may come before the warning).
        if oldest is None or now - oldest <= min(self.config.stall_warning, limit):
            return
        with self._lock:
            own = [(n, t) for n, (_, t) in pairs.own.items() if now - t > limit]
            peer = [(n, q, t) for n, (q, t) in pairs.peer.items() if now - t > limit]
            for name, *_ in own + peer:
                pairs.drop([name])
            # Late requests of these names go to the coordinator, never to a new pair.
            pairs.unpaired.update(n for n, *_ in own + peer)
            waiting = [(n, 0 if n in pairs.peer else 1) for n, (_, t) in
                       [*pairs.own.items(), *pairs.peer.items()]
                       if now - t > self.config.stall_warning and n not in self._pair_warned]
            self._pair_warned.update(n for n, _ in waiting)
        for name, missing in waiting:
            log.warning(
                "collective %r has waited over %.0f s for ranks %s; they may be stuck or call "
                "collectives with other names", name, self.config.stall_warning, [missing])
        for _, request, since in peer:  # rank 1 expects the coordinator's answer
            coord.add(1, request, since)
        for name, _ in own:
            # Rank 1 never asked: the error expire() would give, on both ranks; rank 1
            # also drops rank 0's copy, so a late request of its own fails there too.
            self._pair_warned.discard(name)
            response = m.Response(m.ALLREDUCE, (name,), error=(
                f"collective {name!r}: ranks [1] did not submit it within {limit} s "
                "(a rank is stuck, or ranks call collectives in different orders/names)"))
            with self._send_lock:
                self._send(1, [wire.encode_obj(("resp", [response]))])
            self._execute(response)

    def _leave(self) -> None:
        """Graceful exit: everyone says bye to rank 0, which releases all once all did."""
        if self.size == 1:
            return
        try:
            if self._coordinator is None:
                with self._send_lock:
                    self._send(0, [wire.encode_obj(("bye", None))])
                self._wait_for(lambda: 0 in self._bye_from)
            else:
                self._wait_for(lambda: len(self._bye_from) == self.size - 1)
                with self._send_lock:
                    for peer in self._control:
                        self._send(peer, [wire.encode_obj(("bye", None))])
            # A backlog's sender may still hold the goodbye: let it go before closing.
            deadline = time.monotonic() + _BYE_WAIT_S
            while self._draining and self._failure is None and time.monotonic() < deadline:
                time.sleep(1e-3)
        except HvdSparkError as exc:
            log.debug("rank %d left without a clean goodbye: %s", self.rank, exc)

    def _wait_for(self, condition) -> None:
        deadline = time.monotonic() + _BYE_WAIT_S
        while not condition():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            readable = wire.wait_readable(list(self._control.values()), left)
            for sock in readable:
                peer = self._sock_rank[sock.fileno()]
                kind, _ = wire.recv_obj(sock, f"rank {peer}")
                if kind == "bye":
                    self._bye_from.add(peer)

    def _close(self) -> None:
        # Closing our sockets makes every peer blocked on us fail at once, not at a timeout.
        self._closed = True
        self.comm.close()
        for sock in [*self._control.values(), self._wake_r, self._wake_w]:
            try:
                # Shut down first: a close() alone sends nothing while a thread still
                # waits in a send on it (a backlog's sender, see _send).
                if sock in self._control.values():
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass
        self._fail_pending()
