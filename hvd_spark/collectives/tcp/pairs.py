"""The TCP engine's two-rank shortcut: the ranks decide their small allreduces alone.

With two ranks, each sends the other its eager allreduce requests (rank 0 a copy of its
own, rank 1 its usual request) and both reduce as soon as they hold both halves (see
``collectives.pairing`` for why rank 0 stays the authority). Here is the engine's side:
recording and matching the halves, running agreed pairs, handing them to the coordinator
when pairing must stop (a rank joined or left, a half waited too long), and the express
path, which runs a synchronous allreduce of that kind on the caller's thread with no
entry, handle or cycle (its tensor crossing on the express lane from 32 KB, see
``express_lane``).
"""

from __future__ import annotations

import math
import time

import numpy as np

from hvd_spark.collectives import messages as m
from hvd_spark.collectives import timeline
from hvd_spark.collectives.coordinator import stall_error, warn_stall
from hvd_spark.collectives.engine_core import DRIVE_SLICE_S
from hvd_spark.collectives.operations import Entry, Handle
from hvd_spark.collectives.ops import SUPPORTED_DTYPES, ReduceOp, check_reduction, reduce_rows
from hvd_spark.collectives.pairing import PairTable, disagreement, pairable
from hvd_spark.collectives.tcp import readiness, wire
from hvd_spark.collectives.tcp.express_lane import LANE_MIN_BYTES, ExpressLane
from hvd_spark.errors import CollectiveError, HvdSparkError

# How often rank 0 looks for paired requests waiting too long (stall warning, timeout).
_PAIR_CHECK_S = 0.1
# Checked (dtype, op, scaled) combinations kept (a job uses a handful).
_CHECKED_OPS_KEPT = 64
# How long an express call waits for the progress lock: the background thread, unparked
# after a pause between calls, takes it when the peer's request of this very call wakes
# it, and copies out a lane tensor (4 MB: 1-2 ms); the claim then finds that request
# read. A caller driving longer sends this one the usual way.
_PROGRESS_WAIT_S = 5e-3


class PairingMixin:
    """The pairing half of ``TcpEngine`` (a mixin: it uses the engine's tables, locks,
    coordinator and control sockets).

    ``_init_pairs`` sets up its state; the engine's constructor calls it once.
    """

    def _init_pairs(self, size: int) -> None:
        """Pair only with two ranks (``_pairs`` is None otherwise)."""
        # Two ranks decide their small allreduces alone (see ``pairing``); under _lock.
        self._pairs = PairTable() if size == 2 else None
        # Two ranks on one host: the express lane their tensors cross (a hierarchical
        # communicator, never of two ranks, has none).
        self._lane: ExpressLane | None = (getattr(self.comm, "express_lane", None)
                                          if size == 2 else None)
        self._pair_warned: set[str] = set()
        self._checked_ops: dict[tuple, ReduceOp] = {}  # see _checked_op
        self._next_pair_check = 0.0
        #: Allreduces the two ranks decided alone (see ``pairing``).
        self.paired = 0
        #: Synchronous allreduces ``express_allreduce`` ran alone, and those it handed to
        #: the usual path after sending (something else turned up).
        self.express_rounds = 0
        self.express_fallbacks = 0
        self._coordinated_at = 0.0  # rank 0: when the cycle last coordinated

    # ------------------------------------------------------------------ express path

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
                or array.dtype not in SUPPORTED_DTYPES
                or (inplace and not array.flags.writeable)):
            return None
        if array.nbytes > self.lone_eager_bytes and not self._takes_lane(array.nbytes):
            return None  # too large to ride inline, and no lane (or its buffer is busy)
        try:  # as the usual path reads them; it names what is wrong, too
            postscale = float(postscale)
            op = self._checked_op(array.dtype, op, postscale, name)
        except (TypeError, ValueError, HvdSparkError):
            return None
        if op == ReduceOp.Adasum or not self._progress.acquire(timeout=_PROGRESS_WAIT_S):
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

    def _checked_op(self, dtype: np.dtype, op: int, postscale: float, name: str) -> ReduceOp:
        """``op`` as a ReduceOp, once ``check_reduction`` passed it for ``dtype``: what it
        checks depends on the dtype, the op and whether a scale applies, so a training
        loop's calls are checked once (1.4 us a call saved).

        Raises:
            ValueError, HvdSparkError: As ``ReduceOp`` and ``check_reduction``.
        """
        key = (dtype, op, postscale != 1.0)
        checked = self._checked_ops.get(key)
        if checked is None:
            checked = ReduceOp(op)
            check_reduction(dtype, checked, 1.0, postscale, name)
            if len(self._checked_ops) < _CHECKED_OPS_KEPT:
                self._checked_ops[key] = checked
        return checked

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
                    if peer_request.lane is not None:
                        self._lane.release(peer_request.lane)  # read: its buffer is free
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
        (pickled now: before any reduction into the tensor riding along); from
        ``LANE_MIN_BYTES`` on, or above the inline limit, its tensor crosses the lane."""
        peer = 1 - self.rank
        if self._takes_lane(request.payload.nbytes):
            request = request.with_payload(None, self._lane.post(request.payload))
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
        readable = (readiness.poll_readable(watched, min(self._spin_s, left))
                    or readiness.wait_readable(watched, left))
        if sock not in readable or self._wake_r in readable:
            return None, None  # too slow, or another thread's work: the cycle sends it
        kind, payload = self._recv_control(peer, sock)
        expected = "req" if self._coordinator is not None else "pair"
        if kind == expected:
            self._view_lane(payload)
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

    def _takes_lane(self, nbytes: int) -> bool:
        """Whether an express tensor of ``nbytes`` crosses the lane: from
        ``LANE_MIN_BYTES`` on (or above the inline limit), when a buffer is free. Once
        true it stays true until the tensor is posted (only the peer frees buffers)."""
        return (self._lane is not None
                and (nbytes >= LANE_MIN_BYTES or nbytes > self.lone_eager_bytes)
                and self._lane.can_post(nbytes))

    def _view_lane(self, requests: list[m.Request]) -> None:
        """Replace, in ``requests``, those whose tensors crossed the lane by the same
        request with a view of the lane as payload (requests are values: never changed)."""
        for i, request in enumerate(requests):
            if request.lane is not None and request.payload is None:
                view = self._lane.view(request.lane, request.dtype, math.prod(request.shape))
                requests[i] = request.with_payload(view, request.lane)

    def _settle_lane(self, requests: list[m.Request]) -> None:
        """Replace, in ``requests``, those whose tensors crossed the lane by the same
        request with a copy of the tensor, and free their buffers: the usual path may
        read them any time later."""
        if self._lane is None:
            return
        self._view_lane(requests)
        for i, request in enumerate(requests):
            if request.lane is not None:
                requests[i] = request.with_payload(request.payload.copy())
                self._lane.release(request.lane)

    # ------------------------------------------------------------------ pairing

    def _record_own(self, requests: list[m.Request]) -> None:
        """Record this rank's paired ``requests`` (the caller holds the lock)."""
        now, own = time.monotonic(), self._pairs.own
        for request in requests:
            own[request.name] = (request, now)

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
            warn_stall(name, self.config.stall_warning, [missing])
        for _, request, since in peer:  # rank 1 expects the coordinator's answer
            coord.add(1, request, since)
        for name, _ in own:
            # Rank 1 never asked: the error expire() would give, on both ranks; rank 1
            # also drops rank 0's copy, so a late request of its own fails there too.
            self._pair_warned.discard(name)
            response = m.Response(m.ALLREDUCE, (name,), error=stall_error(name, [1], limit))
            with self._send_lock:
                self._send(1, [wire.encode_obj(("resp", [response.fields()]))])
            self._execute(response)
