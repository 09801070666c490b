"""The TCP engine's express path: a synchronous allreduce of two ranks on the caller's
thread, with no entry, handle or cycle.

With two ranks each sends the other its small allreduce requests and both reduce as
soon as they hold both halves (``tcp.pairs``, ``collectives.pairing``). A synchronous
call made while nothing else is in flight on its rank needs none of the engine's
machinery for that: this thread sends its request, reads the other rank's and reduces
both (its tensor crossing the express lane from 32 KB, see ``express_lane``). Whenever
something else turns up (another frame, another thread's submission, a slow peer), the
rank takes up the state the usual path would have had and the usual cycle goes on.

A small call's cost is Python's own work, so the common case runs few Python
functions (a unit test counts them): what a request of a given dtype, op and scale
looks like on the wire, and how its two halves reduce, is worked out once per job
(``_Plan``); the request is sent and compared as the plain tuple the control sockets
carry (``Request.fields``), and a ``Request`` is built only when the call hands over.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, NamedTuple

import numpy as np

from hvd_spark.collectives import messages as m
from hvd_spark.collectives.coordinator import request_problem
from hvd_spark.collectives.engine_core import DRIVE_SLICE_S
from hvd_spark.collectives.operations import Entry, Handle
from hvd_spark.collectives.ops import ReduceOp, check_reduction, plain_reduction, reduce_rows
from hvd_spark.collectives.pairing import disagreement
from hvd_spark.collectives.tcp import readiness, wire
from hvd_spark.collectives.tcp.control import disconnected, messages_of
from hvd_spark.collectives.tcp.express_lane import LANE_MIN_BYTES
from hvd_spark.collectives.tcp.pairs import PAIR_CHECK_S
from hvd_spark.errors import HvdSparkError, PeerDisconnectedError

# Plans kept, one per (dtype, op, postscale) a job reduces (a job uses a handful).
_PLANS_KEPT = 64
# How long an express call waits for the progress lock: the background thread, unparked
# after a pause between calls, takes it when the peer's request of this very call wakes
# it, and copies out a lane tensor (4 MB: 1-2 ms); the claim then finds that request
# read. A caller driving longer sends this one the usual way.
_PROGRESS_WAIT_S = 5e-3

# Where a request's fields sit in ``Request.fields()``: the ranks agree on all but the
# last two (the tensor and its lane number, which ``Request`` does not compare).
_FIELDS = [f.name for f in dataclasses.fields(m.Request)]
_NAME, _DTYPE, _SHAPE = _FIELDS.index("name"), _FIELDS.index("dtype"), _FIELDS.index("shape")
_AGREED = len(_FIELDS) - 2
if _FIELDS[_AGREED:] != ["payload", "lane"] or not _NAME < _DTYPE < _SHAPE:
    raise ImportError("express: Request's fields moved; update _Plan's layout")  # pragma: no cover


class _Plan(NamedTuple):
    """What an express allreduce of one (dtype, op, postscale) sends and computes.

    Attributes:
        op, postscale: The op, checked for the dtype, and the scale after it.
        before_shape, after_shape: The request's fields around its shape (the name
            first, the tensor and lane last), as ``Request.fields()`` writes them.
        ufunc, factor: ``ops.plain_reduction``'s: numpy's call and the scale after it;
            ufunc None: ``reduce_rows`` does it.
    """

    op: ReduceOp
    postscale: float
    before_shape: tuple
    after_shape: tuple
    ufunc: np.ufunc | None
    factor: float | None


class ExpressMixin:
    """The express half of ``TcpEngine``: caller-side code of the engine itself (it
    claims the engine's progress lock, counts as a driving caller and, when something
    else turns up, leaves the engine in the state a submission would have), kept in a
    module of its own for size. It uses the engine's ``Pairing`` and ``ControlChannel``
    through their interfaces, as the rest of the engine does.

    ``_init_express`` sets up its state; the engine's constructor calls it once, after
    making its parts.
    """

    def _init_express(self) -> None:
        self._plans: dict[tuple, _Plan] = {}
        #: Synchronous allreduces ``express_allreduce`` ran alone, and those it handed to
        #: the usual path after sending (something else turned up).
        self.express_rounds = 0
        self.express_fallbacks = 0
        # The smallest tensor that crosses the lane (none without one).
        self._lane = None if self.pairing is None else self.pairing.lane
        self._lane_from = (math.inf if self._lane is None
                           else min(LANE_MIN_BYTES, self.lone_eager_bytes + 1))
        if self.pairing is not None:
            peer = 1 - self.rank
            self._express_watched = [self.control.socks[peer], self.control.wake_r]
            self._express_kind = "pair" if self._coordinator is not None else "req"
            self._peer_kind = "req" if self._coordinator is not None else "pair"

    def express_allreduce(self, name: str, array: np.ndarray, op: int, postscale: float,
                          inplace: bool) -> np.ndarray | None:
        """A synchronous allreduce the two ranks decide alone (see ``pairing``), with
        nothing else going on: this thread sends its request, reads the other rank's and
        reduces both, with no entry, handle or cycle.

        On the wire it is the usual path's exchange (a pair copy from rank 0, a request
        from rank 1), so a peer on either path agrees with it. Whenever something else
        turns up (another frame, another thread's submission, a slow peer), this rank
        takes up the state the usual path would have had since the submission and the
        usual cycle goes on from there (``_express_fallback``).

        Returns:
            The result (``array`` itself when ``inplace``), or None when this call does
            not qualify (the caller then submits it as usual, under the same name).
        """
        if (self.pairing is None or not array.flags.c_contiguous
                or (inplace and not array.flags.writeable)):
            return None
        if array.nbytes > self.lone_eager_bytes and not self._takes_lane(array.nbytes):
            return None  # too large to ride inline, and no lane (or its buffer is busy)
        try:
            plan = self._plans.get((array.dtype, op, postscale))
        except TypeError:  # an unhashable op or scale: the usual path names what is wrong
            return None
        if plan is None:
            plan = self._plan(array.dtype, op, postscale, name)
            if plan is None:
                return None
        return self._express_call(name, self._express_run, plan, array, inplace)

    def _express_call(self, name: str, run, *args) -> Any:
        """Run ``run(name, held, *args)`` as an express call of ``name``: with the
        progress lock, the name claimed (``_express_claim``) and this thread counted as
        a driver; ``run`` returns (result, None), or (None, the entry the usual path
        goes on with), whose result this waits for.

        Returns:
            The result, or None when the call cannot go express now (the caller then
            submits it as usual, under the same name).
        """
        if not self._progress.acquire(timeout=_PROGRESS_WAIT_S):
            return None
        try:
            claimed, held = self._express_claim(name)
            if not claimed:
                return None
            try:
                result, entry = run(name, held, *args)
            finally:
                with self._lock:
                    self._drivers -= 1
                    self._driver_left_at = time.monotonic()
        finally:
            self._progress.release()
        return result if entry is None else self.wait(entry.handle)

    def _plan(self, dtype: np.dtype, op: int, postscale: float, name: str) -> _Plan | None:
        """The plan for an allreduce of ``dtype``, ``op`` and ``postscale`` (kept for the
        next call), or None when express does not take it (Adasum; or the checks the
        usual path makes fail, which it then reports in its own words)."""
        try:
            scale = float(postscale)
            checked = ReduceOp(op)
            check_reduction(dtype, checked, 1.0, scale, name)
        except (TypeError, ValueError, HvdSparkError):
            return None
        dtype_name = m.dtype_name(dtype)
        if checked == ReduceOp.Adasum or request_problem(
                m.ALLREDUCE, dtype_name, int(checked), 1.0, scale, -1, 2) is not None:
            return None
        fields = m.Request(name, m.ALLREDUCE, dtype_name, (), int(checked), 1.0,
                           scale).fields()
        ufunc, factor = plain_reduction(dtype, checked, scale, 2) or (None, None)
        plan = _Plan(checked, scale, fields[_NAME + 1:_SHAPE], fields[_SHAPE + 1:_AGREED], ufunc,
                     factor)
        if len(self._plans) < _PLANS_KEPT:
            self._plans[(dtype, op, postscale)] = plan
        return plan

    def _express_claim(self, name: str) -> tuple[bool, m.Request | None]:
        """Claim ``name`` when this rank has nothing else in flight and would pair it (as
        ``_submit_on_rank_0`` decides); also the other rank's request of it, when a cycle
        read that already."""
        pairing, control = self.pairing, self.control
        pairs = pairing.table
        with self._lock:
            peer_names = pairs.peer
            if (self._failure is not None or self._stopping or self._pending
                    or self._queue or any(control.outbox.values()) or control.draining
                    or pairs.own or name in self._names_in_flight
                    or (peer_names and (len(peer_names) > 1 or name not in peer_names))):
                return False, None
            coord = self._coordinator
            if coord is not None and (
                    not self._pairing_open() or name in pairs.unpaired
                    or not coord.quiet(name, time.monotonic() - self._coordinated_at
                                       <= PAIR_CHECK_S)):
                # A decision due now is the cycle's to send; and requests waiting for
                # this rank need the cycle's stall warnings and timeout now and then
                # (a loop of express calls would otherwise keep it from ever running).
                return False, None
            self._names_in_flight.add(name)
            # A driver meanwhile: a submission from another thread wakes this one (which
            # then leaves the rest to the cycle), and the background thread stays parked.
            self._drivers += 1
            held = pairs.peer.pop(name, None) if peer_names else None
            pairing.warned.discard(name)  # as Pairing._decide does for a pair it runs
        return True, None if held is None else held[0]

    def _express_run(self, name: str, held: m.Request | None, plan: _Plan, array: np.ndarray,
                     inplace: bool) -> tuple[np.ndarray | None, Entry | None]:
        """Send this rank's request, take the other rank's and reduce: (result, None);
        or, when the usual path must go on, (None, the entry it waits for)."""
        try:
            # A small result goes to a numpy caller: no pool, no alignment (the TensorFlow
            # binding aligns what it adopts itself).
            out = array if inplace else np.empty(array.shape, array.dtype)
            flat = array.reshape(-1)
            lane = None
            if array.nbytes >= self._lane_from and self._lane.can_post(array.nbytes):
                lane = self._lane.post(flat)  # (as _takes_lane: the caller asked it)
            if lane is not None:
                payload = None
            elif array.nbytes < m.OUT_OF_BAND_MIN_BYTES:
                payload = flat.tobytes()  # (what wire_bytes gives it)
            else:
                payload = m.wire_bytes(flat)
            own = (name, *plan.before_shape, array.shape, *plan.after_shape, payload, lane)
            peer = 1 - self.rank
            # Pickled now: before any reduction into the tensor riding along.
            frame = wire.encode_obj((self._express_kind, [own]), pooled=True)
            control = self.control
            with control.send_lock:
                control.send(peer, [frame])
            if held is not None:
                return self._express_held(name, own, plan, array, out, held)
            fields, message = self._express_read(name)
            if (fields is None or fields[:_AGREED] != own[:_AGREED]
                    or (fields[-2] is None and fields[-1] is None)):
                # Not this call's twin (another message, a late or different request):
                # the usual path decides, as it would have.
                return None, self._express_fallback(name, own, array, out, None, message)
            peer_lane = fields[-1]
            mine = flat
            theirs = (np.frombuffer(fields[-2], array.dtype) if peer_lane is None
                      else self._lane.view(peer_lane, own[_DTYPE], array.size))
            first, second = (mine, theirs) if self.rank == 0 else (theirs, mine)
            result = out.reshape(-1)
            ufunc = plan.ufunc
            if ufunc is None:
                reduce_rows([first, second], plan.op, plan.postscale, out=result)
            else:
                ufunc(first, second, out=result)
                if plan.factor is not None:
                    np.multiply(result, plan.factor, out=result, casting="unsafe")
            if peer_lane is not None:
                self._lane.release(peer_lane)  # read: its buffer is free
            self.express_rounds += 1  # (_express_done's lines, run on every call)
            self.pairing.paired += 1
            self.executed_responses += 1
            self.executed_tensors += 1
            self.executed_eager += 1
            with self._lock:
                self._names_in_flight.discard(name)
            return out, None
        except BaseException as exc:  # noqa: BLE001 - as a waiting caller's _drive
            raise self._express_failed(name, exc) from exc

    def _express_failed(self, name: str, exc: BaseException) -> BaseException:
        """Fail the engine with ``exc``, raised in an express call of ``name`` (as a
        waiting caller's ``_drive`` does; an entry the fallback made pending is failed
        with every other one), free the name, and return the error to raise."""
        self._fail(exc)
        self._failed_while_driving()
        with self._lock:
            self._names_in_flight.discard(name)
        return self._error_for(name)

    def _express_done(self, name: str) -> None:
        """Count an express call that ran alone and free its name."""
        self.pairing.paired += 1
        self.express_rounds += 1
        self.executed_responses += 1
        self.executed_tensors += 1
        self.executed_eager += 1
        with self._lock:
            self._names_in_flight.discard(name)

    def _express_held(self, name: str, own: tuple, plan: _Plan, array: np.ndarray,
                      out: np.ndarray, held: m.Request) -> tuple[np.ndarray | None,
                                                                 Entry | None]:
        """``_express_run`` with the other rank's request read by a cycle already (after
        a pause between calls): as Requests, as the cycle left it."""
        request = self._own_request(own, array)
        first, second = (request, held) if self.rank == 0 else (held, request)
        if disagreement(name, first, second) is None:
            reduce_rows([first.payload, second.payload], plan.op, request.postscale,
                        out=out.reshape(-1))
            self._express_done(name)
            return out, None
        return None, self._express_fallback(name, own, array, out, held, None)

    def _express_read(self, name: str) -> tuple[tuple | None, tuple | None]:
        """The other rank's next control message when it comes within a slice: the
        fields of its request of ``name`` when that is all it is, else None with the
        message read (None when none was: too slow, or another thread's work)."""
        watched = self._express_watched
        readable = (readiness.poll_readable(watched, min(self._spin_s, DRIVE_SLICE_S))
                    or readiness.wait_readable(watched, DRIVE_SLICE_S))
        sock = watched[0]
        if len(readable) != 1 or readable[0] is not sock:
            return None, None  # too slow, or another thread's work: the cycle sends it
        peer = 1 - self.rank
        try:
            kind, payload = wire.recv_obj(sock, f"rank {peer}", pooled=True)
        except PeerDisconnectedError:
            raise disconnected(peer, self.rank) from None
        if kind == self._peer_kind and len(payload) == 1 and payload[0][_NAME] == name:
            return payload[0], (kind, payload)
        return None, (kind, payload)

    def _own_request(self, own: tuple, array: np.ndarray) -> m.Request:
        """This rank's request as a Request, its payload the caller's tensor (the lane
        number only named it on the wire)."""
        return m.Request(*own[:_AGREED], array.reshape(-1))

    def _express_fallback(self, name: str, own: tuple, array: np.ndarray, out: np.ndarray,
                          peer_request: m.Request | None, message: tuple | None) -> Entry:
        """Take up the usual path's state for this call: its entry pending and its
        request recorded as paired (as at submission), the other rank's request or the
        message read meanwhile handled as a cycle would; the usual wait goes on."""
        request = self._own_request(own, array)
        # Out of place, the backend reads the caller's input (a joined rank's round runs
        # the allreduce there, not from the payloads).
        entry = Entry(request, Handle(name), out, source=None if out is array else array)
        return self._express_handover(entry, peer_request, message)

    def _express_handover(self, entry: Entry, peer_request: m.Request | None,
                          message: tuple | None) -> Entry:
        """``_express_fallback`` once the call's ``entry`` is made (any paired kind)."""
        self.express_fallbacks += 1
        name, request = entry.request.name, entry.request
        now = time.monotonic()
        with self._lock:
            self._pending[name] = entry
            self.pairing.table.own[name] = (request, now)
        peer = 1 - self.rank
        if peer_request is not None:
            self._on_message(peer, self._peer_kind, [peer_request])
        elif message is not None:
            self._on_message(peer, *messages_of(*message))
        self.pairing.run()
        return entry

    def _takes_lane(self, nbytes: int) -> bool:
        """Whether an express tensor of ``nbytes`` crosses the lane: from
        ``LANE_MIN_BYTES`` on (or above the inline limit), when a buffer is free. Once
        true it stays true until the tensor is posted (only the peer frees buffers)."""
        return nbytes >= self._lane_from and self._lane.can_post(nbytes)

