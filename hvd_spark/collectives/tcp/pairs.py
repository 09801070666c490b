"""The TCP engine's two-rank shortcut: the ranks decide their small allreduces alone.

With two ranks, each sends the other its eager allreduce requests (rank 0 a copy of its
own, rank 1 its usual request) and both reduce as soon as they hold both halves (see
``collectives.pairing`` for why rank 0 stays the authority). Here is the engine's side:
recording and matching the halves, running agreed pairs, handing them to the coordinator
when pairing must stop (a rank joined or left, a half waited too long), and the views
of tensors that crossed the express lane (``express_lane``). The express path, which
runs a synchronous allreduce of that kind on the caller's thread, is ``tcp.express``.

The engine owns one ``Pairing`` (with two ranks only). It shares the engine's lock and
coordinator, sends through the engine's ``ControlChannel``, and runs what it decides
through three callbacks: whether pairing is open, running a response, and reducing an
agreed pair into its entry.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from hvd_spark.collectives import messages as m
from hvd_spark.collectives.communicator import ExpressLane
from hvd_spark.collectives.coordinator import Coordinator, stall_error, warn_stall
from hvd_spark.collectives.pairing import PairTable, disagreement, pairable
from hvd_spark.collectives.tcp import wire
from hvd_spark.collectives.tcp.control import ControlChannel
from hvd_spark.config import EngineConfig
from hvd_spark.errors import CollectiveError

# How often rank 0 looks for paired requests waiting too long (stall warning, timeout).
PAIR_CHECK_S = 0.1


class Pairing:
    """Two ranks' paired requests: recording, matching, deciding and policing them.

    Args:
        rank: This rank (0 or 1).
        lane: The express lane the ranks' tensors may cross, or None.
        config: The engine's settings (stall warning).
        lock: The engine's lock: the table is used under it, by callers' threads and
            the cycle alike.
        coordinator: Rank 0's coordinator (None on rank 1).
        control: The engine's control sockets.
        may_pair: Rank 0: whether new requests may be paired (the coordinator would add
            nothing to them).
        execute: Runs a response on this rank (an error response, a stall's).
        finish: Reduces an agreed pair (name, rank 0's request, rank 1's) into this
            rank's entry and completes it.

    Attributes:
        table: The requests waiting for their other half.
        lane: As given.
        warned: Names a stall warning was given for (until decided).
        paired: Allreduces the two ranks decided alone (see ``pairing``).
    """

    def __init__(self, rank: int, lane: ExpressLane | None, config: EngineConfig,
                 lock: threading.Lock, coordinator: Coordinator | None,
                 control: ControlChannel, may_pair: Callable[[], bool],
                 execute: Callable[[m.Response], None],
                 finish: Callable[[str, m.Request, m.Request], None]) -> None:
        self.rank = rank
        self.lane = lane
        self.config = config
        self._lock = lock
        self._coordinator = coordinator
        self._control = control
        self._may_pair = may_pair
        self._execute = execute
        self._finish = finish
        self.table = PairTable()
        self.warned: set[str] = set()
        self._next_check = 0.0
        self.paired = 0

    def __bool__(self) -> bool:
        """Whether any request waits for its other half."""
        table = self.table  # (not bool(table): one Python call less per message)
        return bool(table.own or table.peer)

    # ------------------------------------------------------------------ express lane

    def view_lane(self, requests: list[m.Request]) -> None:
        """Replace, in ``requests``, those whose tensors crossed the lane by the same
        request with a view of the lane as payload (requests are values: never changed)."""
        for i, request in enumerate(requests):
            if request.lane is not None and request.payload is None:
                view = self.lane.view(request.lane, request.dtype, math.prod(request.shape))
                requests[i] = request.with_payload(view, request.lane)

    def settle_lane(self, requests: list[m.Request]) -> None:
        """Replace, in ``requests``, those whose tensors crossed the lane by the same
        request with a copy of the tensor, and free their buffers: the usual path may
        read them any time later."""
        if self.lane is None:
            return
        self.view_lane(requests)
        for i, request in enumerate(requests):
            if request.lane is not None:
                requests[i] = request.with_payload(request.payload.copy())
                self.lane.release(request.lane)

    # ------------------------------------------------------------------ recording

    def record_own(self, requests: list[m.Request]) -> None:
        """Record this rank's paired ``requests`` (the caller holds the lock)."""
        now, own = time.monotonic(), self.table.own
        for request in requests:
            own[request.name] = (request, now)

    def add_peer(self, request: m.Request, now: float) -> None:
        """Rank 0: one of rank 1's requests, paired, held, or to the coordinator."""
        coord, pairs, name = self._coordinator, self.table, request.name
        self._match_previous(name)
        with self._lock:
            own = pairs.own.get(name)
            if pairable(request) and (own is not None or (
                    self._may_pair() and not coord.waiting_for(name)
                    and name not in pairs.unpaired)):
                pairs.peer[name] = (request, now)  # decided now, or once rank 0 asks
                return
            if own is not None:  # rank 1's cannot be paired: neither can rank 0's
                del pairs.own[name]
            elif not coord.waiting_for(name):  # rank 0 has yet to ask: it must not pair
                pairs.unpaired.add(name)  # (TcpEngine._submit_on_rank_0 checks under it)
        if own is not None:
            coord.add(0, own[0], own[1])
        coord.add(1, request, now)

    def hold_peer(self, request: m.Request, now: float) -> None:
        """Rank 1: record rank 0's copy of a paired request."""
        self._match_previous(request.name)
        with self._lock:
            self.table.peer[request.name] = (request, now)

    def drop(self, names) -> None:
        """Forget ``names`` (the coordinator answered them)."""
        with self._lock:
            self.table.drop(names)

    def _match_previous(self, name: str) -> None:
        """Before the other rank's next request of ``name`` is recorded, decide its
        previous one, still unmatched: it cannot replace that one.

        Its partner is recorded already (each rank records its own before it sends, and
        the other moves on to the next request of a name only once it has this rank's),
        unless the other rank broke the protocol.
        """
        pairs = self.table
        if name not in pairs.peer:
            return
        self.run()
        if name in pairs.peer:
            raise CollectiveError(
                f"rank {1 - self.rank} sent a second request of {name!r} before its first was "
                "answered; the ranks disagree on that collective's history")

    # ------------------------------------------------------------------ deciding

    def run(self) -> bool:
        """Decide and run every name both ranks have paired; True when one ran."""
        pairs = self.table
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
            self._control.flush()
        for name, own, peer in matched:
            if self.warned:
                self.warned.discard(name)
            first, second = (own, peer) if self.rank == 0 else (peer, own)
            error = disagreement(name, first, second)
            if error is not None:
                self._execute(error)
            else:
                self._finish(name, first, second)
            self.paired += 1

    # ------------------------------------------------------------------ rank 0's policing

    def _release(self) -> None:
        """Rank 0, once a rank joined or left: what waits to be paired goes to the
        coordinator instead (rank 0's own only when rank 1 can no longer ask for them,
        or it might decide them alone while the coordinator does too)."""
        coord, pairs = self._coordinator, self.table
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

    def check(self, now: float, limit: float) -> None:
        """Rank 0: stall warnings and the timeout for requests waiting to be paired."""
        coord, pairs = self._coordinator, self.table
        if coord.joined or coord.departed:
            self._release()
        if now < self._next_check:
            return
        self._next_check = now + PAIR_CHECK_S
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
                       if now - t > self.config.stall_warning and n not in self.warned]
            self.warned.update(n for n, _ in waiting)
        for name, missing in waiting:
            warn_stall(name, self.config.stall_warning, [missing])
        for _, request, since in peer:  # rank 1 expects the coordinator's answer
            coord.add(1, request, since)
        for name, _ in own:
            # Rank 1 never asked: the error expire() would give, on both ranks; rank 1
            # also drops rank 0's copy, so a late request of its own fails there too.
            self.warned.discard(name)
            response = m.Response(m.ALLREDUCE, (name,), error=stall_error(name, [1], limit))
            with self._control.send_lock:
                self._control.send(1, [wire.encode_obj(("resp", [response.fields()]))])
            self._execute(response)
