"""The TCP backend's engine: negotiation through rank 0 over control sockets.

Callers enqueue named requests and get handles. Rank 0's engine coordinates: the
others send it their requests over their control sockets; once every rank asked
for a name (and they agree), it sends the same ordered response list to all, and
every rank runs it on the backend. So ranks may issue operations in any order,
and a disagreement becomes an error on every rank instead of a hang.

With two ranks, small allreduces, broadcasts and allgathers skip rank 0's decision: each
rank sends the other its request and both decide alone (``tcp.pairs``), a synchronous one
on the caller's thread (``tcp.express``, ``tcp.express_moves``). The engine owns its
parts: the control sockets (a ``ControlChannel``: holding, sending, waking, receiving,
leaving) and, with two ranks, the ``Pairing``.

The cycle runs on the background thread, or on a caller's thread while it waits
(``EngineCore.wait``); the background thread parks meanwhile, so the two never
race for a control socket's messages.
"""

from __future__ import annotations

import socket
import threading
import time

from hvd_spark.collectives import messages as m
from hvd_spark.collectives import timeline
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.coordinator import Coordinator
from hvd_spark.collectives.engine_core import PARK_S, EngineCore, timeline_row
from hvd_spark.collectives.operations import Entry
from hvd_spark.collectives.pairing import pair_output, pairable
from hvd_spark.collectives.tcp import readiness, wire
from hvd_spark.collectives.tcp.control import ControlChannel
from hvd_spark.collectives.tcp.express import ExpressMixin
from hvd_spark.collectives.tcp.express_moves import ExpressMovesMixin
from hvd_spark.collectives.tcp.pairs import Pairing
from hvd_spark.config import EngineConfig
from hvd_spark.errors import CollectiveError, HvdSparkError, PeerDisconnectedError

_IDLE_POLL_S = 1.0
# Rank 0's background thread, woken by a local submission, first gives the submitting
# thread this long to come and wait (a synchronous call does at once): then that thread
# runs the operation itself, instead of receiving the result across threads.
_GRACE_S = 200e-6
# Most control frames read from one peer in one cycle: all that wait (requests, pair
# copies and responses queue up while a ring runs), so they are decided and fused
# together, but never without end.
_FRAMES_PER_CYCLE = 256


class TcpEngine(ExpressMovesMixin, ExpressMixin, EngineCore):
    """Runs one rank's collectives: a background thread, or the waiting caller.

    Attributes:
        control: The control sockets (``ControlChannel``).
        pairing: With two ranks, the requests they decide alone (``Pairing``); else None.

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
        self.control = ControlChannel(rank, size, control, lambda: self._failure,
                                      self._record_failure)
        self._coordinator = (Coordinator(size, config.fusion_threshold, self.eager_bytes,
                                         self.lone_eager_bytes)
                             if rank == 0 else None)
        self._start_autotune(self._coordinator)
        # Two ranks decide their small allreduces alone (see ``pairing``); the express
        # lane their tensors cross is the communicator's (a hierarchical one has none).
        self.pairing = (Pairing(rank, comm.express_lane, config, self._lock, self._coordinator,
                                self.control, self._pairing_open, self._execute,
                                self._finish_pair)
                        if size == 2 else None)
        self._coordinated_at = 0.0  # rank 0: when the cycle last coordinated
        self._init_express()
        self._init_express_moves()
        if self.pairing is not None:
            self.paired_gather_bytes = self.eager_bytes
        # A caller waiting for its operation polls this long before sleeping in select
        # (init() resolves the setting against the ranks on this host).
        self._spin_s = config.spin_seconds(size)
        self._watching = False  # the background thread selects on the control sockets
        self._parked = False  # the background thread stands aside for driving callers
        self._thread = threading.Thread(target=self._run, name="hvd-engine", daemon=True)
        self._thread.start()

    @property
    def paired(self) -> int:
        """Allreduces the two ranks decided alone (0 with more ranks; see ``pairing``)."""
        return 0 if self.pairing is None else self.pairing.paired

    @property
    def frames_sent(self) -> int:
        """Control frames this rank sent (a burst of submissions shares one)."""
        return self.control.frames_sent

    def _record_failure(self, exc: BaseException) -> None:
        """The control channel could not send: fail the engine (the first reason stays)."""
        with self._lock:
            if self._failure is None:
                self._failure = exc

    def _pairing_open(self) -> bool:
        """Rank 0: whether new requests may be paired (the coordinator would add nothing)."""
        coord = self._coordinator
        return (not coord.joined and not coord.departed and self._tuner is None
                and timeline.current() is None and not self._stopping)

    def _finish_pair(self, name: str, first: m.Request, second: m.Request) -> None:
        """Run an agreed pair straight into this rank's entry and complete it."""
        with self._lock:
            entry = self._pending.pop(name, None)
        if entry is None:
            raise CollectiveError(f"rank {self.rank} paired {name!r}, which it never submitted")
        try:
            # Straight into this rank's output, which may be its own tensor's memory.
            output = pair_output(first, second, entry.array)
            entry.source = None
            result = entry.finish(output)
        except BaseException as exc:
            self._complete(entry, error=CollectiveError(
                f"collective {name!r} failed on rank {self.rank}: {exc!r}"))
            raise
        self.executed_responses += 1
        self.executed_tensors += 1
        self.executed_eager += 1
        self._complete(entry, result=result)

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
            self.control.wake()

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
        control = self.control
        with control.send_lock:  # requests leave in the order they were recorded
            with self._lock:
                if self.pairing is not None:
                    self.pairing.record_own([r for r in requests if pairable(r)])
                control.hold(0, "req", requests)

    def _submit_on_rank_0(self, entries: list[Entry]) -> None:
        """Queue the requests for the coordinator, but for those the two ranks decide
        alone: a copy of those is held for rank 1.

        The copy is held under the send lock taken before the requests are recorded, so
        no response for them (sent under the same lock, after what is held) can
        overtake it on the wire.
        """
        rest, pairs = entries, self.pairing
        if pairs is not None:
            with self.control.send_lock:
                with self._lock:
                    pairing, unpaired = self._pairing_open(), pairs.table.unpaired
                    paired, rest = [], []
                    for entry in entries:
                        request = entry.request
                        if pairing and pairable(request) and request.name not in unpaired:
                            paired.append(entry)
                        else:
                            rest.append(entry)
                    if paired:
                        requests = [e.request for e in paired]
                        pairs.record_own(requests)
                        self.control.hold(1, "pair", requests)  # (as in _submit_to_rank_0)
        if rest:
            with self._lock:
                self._queue.extend(rest)

    def _driver_arrived(self) -> None:
        if self._watching:
            self.control.wake()  # it must leave the control sockets to this caller

    def _drive(self, timeout: float) -> None:
        self._cycle(timeout, spin=self._spin_s)

    def _failed_while_driving(self) -> None:
        self.control.tell_others(self._failure)
        self.control.wake()  # the background thread sees the failure and closes

    def shutdown(self) -> None:
        """Leave the job gracefully: tell the coordinator, wait for all ranks, close."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self.control.wake()
        self._thread.join(self.config.timeout)

    def abort(self, error: HvdSparkError) -> None:
        """Fail this rank's collectives now with ``error`` (from any thread).

        Used when the launcher reports a lost peer: operations blocked on it fail at once
        with that reason instead of waiting for the collective timeout.
        """
        with self._lock:
            if self._failure is None:
                self._failure = error
        # Before the sockets go: the peers learn why, not just that this rank left.
        self.control.tell_others(self._failure)
        self.control.shut_down()
        self.comm.abort()
        self.control.wake()

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
                        self.control.leave()
                        return
                    self._cycle(0.0)
                    timeout = self._next_timeout()
                self._watch(timeout)
        except BaseException as exc:  # noqa: BLE001 - every error fails the pending handles
            self._fail(exc)
            self.control.tell_others(self._failure)
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
            control = self.control
            readable = readiness.wait_readable([control.wake_r, *control.socks.values()],
                                               timeout)
            if (readable == [control.wake_r] and (self._queue or any(control.outbox.values()))
                    and not self._drivers):
                time.sleep(_GRACE_S)  # then park if the submitter came to drive
        finally:
            self._watching = False

    def _next_timeout(self) -> float:
        if self._coordinator is not None and self._coordinator.has_ready():
            return self._linger(self._coordinator, time.monotonic())
        return _IDLE_POLL_S

    def _cycle(self, max_wait: float, spin: float = 0.0) -> None:
        """Wait up to ``max_wait`` s for messages, then handle all that arrived.

        With ``spin`` (a caller waiting for its result), poll that long before sleeping:
        a small operation's answer usually comes within it, and waking from a sleep costs
        more than the whole operation does on a VM.
        """
        control, pairs = self.control, self.pairing
        decided = pairs is not None and pairs.run()
        control.flush()  # before blocking: the answers to these are what it waits for
        timeout = 0.0 if self._queue or decided else min(max_wait, self._next_timeout())
        wake_r = control.wake_r
        watched = [wake_r, *control.socks.values()]
        readable = readiness.poll_readable(watched, min(spin, timeout))
        if not readable:
            readable = readiness.wait_readable(watched, timeout)
        new = self._drain_local(wake_r in readable)
        control.flush()  # what was submitted until the wake was read (see drain_wake)
        tl = timeline.current() if self._coordinator is not None else None
        if tl is not None:
            tl.mark_cycle()
            for entry in new:
                tl.negotiate_start(timeline_row(entry.request.name, entry.request.kind),
                                   entry.request.kind)
        if self._coordinator is not None and new:
            self._add_own(new)
        for sock in readable:
            if sock is not wake_r:
                self._read_frames(sock)
        if pairs is not None:
            pairs.run()
        if self._coordinator is not None:
            self._coordinate()

    def _read_frames(self, sock: socket.socket) -> None:
        """Handle every control frame ``sock`` has waiting (up to ``_FRAMES_PER_CYCLE``).

        Several may wait (requests, pair copies, responses: they queue up while a ring
        runs). Read one a cycle, as before, a burst of 161 gradients took 161 cycles and
        rank 0 answered them in fused batches of a few as they trickled in; read
        together, they are decided (and fused) together.
        """
        peer = self.control.peer_by_fd[sock.fileno()]
        for _ in range(_FRAMES_PER_CYCLE):
            self._on_control(peer, sock)
            if self._failure is not None or not readiness.wait_readable([sock], 0.0):
                return

    def _add_own(self, new: list[Entry]) -> None:
        """Rank 0: its own new requests for the coordinator (with rank 1's, if rank 1
        paired one that rank 0 could not)."""
        coord, pairs = self._coordinator, self.pairing
        now = time.monotonic()
        for entry in new:
            request = entry.request
            if pairs is not None:
                with self._lock:  # (inline: each call here costs every collective)
                    held = pairs.table.peer.pop(request.name, None)
                    pairs.table.unpaired.discard(request.name)
                if held is not None:
                    coord.add(1, held[0], held[1])
            coord.add(0, request, now)

    def _drain_local(self, woken: bool) -> list[Entry]:
        if woken:
            self.control.drain_wake()
        if not self._queue:
            return []
        with self._lock:
            new = list(self._queue)
            self._queue.clear()
        return new

    def _on_control(self, peer: int, sock: socket.socket) -> None:
        self._on_message(peer, *self.control.recv(peer, sock))

    def _on_message(self, peer: int, kind: str, payload) -> None:
        """Handle one control message from ``peer``."""
        what, pairs = f"rank {peer}", self.pairing
        if kind in ("req", "pair") and pairs is not None:
            pairs.settle_lane(payload)
        if kind == "req":
            now = time.monotonic()
            tl = timeline.current()
            for request in payload:
                if tl is not None:
                    row = timeline_row(request.name, request.kind)
                    tl.negotiate_start(row, request.kind)
                    tl.negotiate_rank_ready(row, peer)
                if pairs is not None:
                    pairs.add_peer(request, now)
                else:
                    self._coordinator.add(peer, request, now)
        elif kind == "pair":
            now = time.monotonic()
            for request in payload:
                pairs.hold_peer(request, now)
        elif kind == "resp":
            if pairs:
                pairs.run()  # quick, and their callers need not wait for the ring
            for response in payload:
                if pairs:
                    pairs.drop(response.names)
                self._execute(response)
        elif kind == "abort":
            error = PeerDisconnectedError(f"{payload} (as rank {peer} saw it)")
            error.root_reason, error.told_by = payload, peer  # passed on as it came
            raise error
        elif kind == "bye":
            self.control.bye_from.add(peer)
            if self._coordinator is None:
                raise CollectiveError("rank 0 called shutdown(); no more collectives can run")
            self._coordinator.depart(peer, "called shutdown()")
        else:
            raise CollectiveError(f"unexpected control message {kind!r} from {what}")

    def _coordinate(self) -> None:
        coord, pairs = self._coordinator, self.pairing
        now = self._coordinated_at = time.monotonic()
        # Requests waiting to be paired (two ranks) stall and expire like the rest.
        coord.police_stalls(now, self.config, before_expiry=(
            (lambda limit: pairs.check(now, limit)) if pairs else None))
        if not coord.has_ready() or self._linger(coord, time.monotonic()) > 0:
            return
        self._first_ready = None
        responses = coord.take_responses()
        self._taken(coord, responses)
        frame = wire.encode_obj(("resp", [r.fields() for r in responses]),  # once for all
                                pooled=True)
        control = self.control
        with control.send_lock:  # callers' threads hold pair copies for these sockets too
            for peer in control.socks:
                control.send(peer, [frame])
        for response in responses:
            self._execute(response)

    def _close(self) -> None:
        # Closing our sockets makes every peer blocked on us fail at once, not at a timeout.
        self._closed = True
        self.comm.close()
        self.control.close()
        self._fail_pending()
