"""The collectives engine of MPI jobs: negotiation rounds over MPI, as Horovod's MPI controller.

Every rank's background thread (or a caller waiting on it) runs the same cycle: it
shares the requests submitted since the last cycle with every rank
(``Negotiation.share``); rank 0's coordinator (the same pure logic as the TCP engine's)
answers with the responses to run, and every rank runs them in that order on the
``MpiCommunicator``. When every rank asks for the same small allreduces they already
agreed on before (``ResponseCache``) and rank 0's coordinator has nothing in hand, the
ranks need no answer: each reduces the tensors that came with the requests itself. A
cycle starts as soon as a request is submitted, or after the cycle time when idle (a rank
joins its peers' cycles even when it has nothing to ask). A shutdown on any rank ends the
engine on every rank together, as in Horovod; the others fail what they still submit,
with the reason.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time

import numpy as np

from hvd_spark.collectives import messages as m
from hvd_spark.collectives import timeline
from hvd_spark.collectives.buffers import OUTPUTS, SegmentedBuffer
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.coordinator import Coordinator
from hvd_spark.collectives.engine_core import PARK_S, EngineCore, timeline_row
from hvd_spark.collectives.messages import Request
from hvd_spark.collectives.mpi.communicator import MpiCommunicator
from hvd_spark.collectives.mpi.negotiation import SLOT_BYTES, Negotiation, Shared
from hvd_spark.collectives.mpi.response_cache import (
    PICKLED,
    Labeler,
    ResponseCache,
    cacheable,
)
from hvd_spark.collectives.operations import Entry, Handle
from hvd_spark.collectives.ops import SUPPORTED_DTYPES, ReduceOp, finish_reduction, reduce_rows
from hvd_spark.config import EngineConfig
from hvd_spark.errors import CollectiveError, HvdSparkError

log = logging.getLogger(__name__)

# After one rank's shutdown, how long the others may go on before all stop together.
BYE_WAIT_S = 10.0
# Idle cycles come at least this often (with a cycle time of 0, a busy loop otherwise).
_MIN_TICK_S = 0.5e-3
# After a cycle that ran something, how long to poll for the next submission.
_LINGER_S = 200e-6
# Largest eager allreduce under MPI: it and its request fit one negotiation slot.
_EAGER_CAP = SLOT_BYTES - 1024
# Rank 0's flag: its coordinator holds nothing, so the ranks may decide an agreed round alone.
_IDLE = 1


class MpiEngine(EngineCore):
    """Runs one rank's collectives, negotiating over MPI: in a background thread, or on
    the thread of a caller that waits (see ``EngineCore``).

    Args:
        comm: The data communicator.
        negotiation: The control rounds (a communicator of their own).
        config: Fusion, cycle and timeout settings.
        routed: What runs the operations, when not ``comm`` itself (``comm`` wrapped so
            device buffers take a device path).
    """

    def __init__(self, comm: MpiCommunicator, negotiation: Negotiation,
                 config: EngineConfig, routed: Communicator | None = None) -> None:
        super().__init__(comm.rank, comm.size, routed or comm, config)
        # Only what fits a negotiation slot with its request rides along: a longer
        # message takes a second gather, and MPI's own allreduce is cheaper than that.
        self.eager_bytes = self.lone_eager_bytes = min(config.eager_limit(comm.size),
                                                       _EAGER_CAP)
        self.mpi_comm = comm
        self._negotiation = negotiation
        self._coordinator = (Coordinator(self.size, config.fusion_threshold, self.eager_bytes)
                             if self.rank == 0 else None)
        self._start_autotune(self._coordinator)  # fusion and cycle time; MPI has no chunk
        self._tick = max(config.cycle_time_ms / 1000.0, _MIN_TICK_S)
        self._wakeup = threading.Event()
        self._bye_since: dict[int, float] = {}  # rank 0: who said goodbye, when
        self._busy_since: float | None = None  # the last cycle that ran something
        self._cache = ResponseCache()
        self._labeler = Labeler() if self.rank == 0 else None
        #: Rounds every rank decided alone, from the response cache.
        self.cached_rounds = 0
        #: Of those, synchronous allreduces run by ``express_allreduce`` alone; and the
        #: express calls that went on as usual submissions (the ranks' messages differed).
        self.express_rounds = 0
        self.express_fallbacks = 0
        self._stopped = False  # a round agreed that every rank stops
        self.cycles = 0
        self._thread = threading.Thread(target=self._run, name="hvd-engine-mpi", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side

    def _submitted(self, entries: list[Entry]) -> None:
        # A waiting caller runs the round itself; an unwaited one goes within a tick.
        if not self._parked():
            self._wakeup.set()

    def express_allreduce(self, name: str, array: np.ndarray, op: int, postscale: float,
                          inplace: bool) -> np.ndarray | None:
        """A synchronous allreduce the ranks agreed on before (the response cache knows
        it), in one round on this thread with no entry, handle or queue; a small tensor
        rides along and every rank reduces it, a larger one runs on the backend next.

        The round is the one ``_round`` would run: the same message, so peers on the
        usual path agree with it. When the ranks did not all send this allreduce alone
        (or rank 0 must decide), it continues as a usual submission of it.

        Returns:
            The result (``array`` itself when ``inplace``), or None when this call does
            not qualify (the caller then submits it as usual, under the same name).
        """
        if (array.dtype not in SUPPORTED_DTYPES or not array.flags.c_contiguous
                or (inplace and not array.flags.writeable) or self._pending or self._queue
                or self._failure is not None or self._stopping or self._stopped):
            return None  # the usual path checks (and names the problem), or waits its turn
        try:  # as the usual path reads them, so every rank computes the same bits
            op, postscale = ReduceOp(op), float(postscale)
        except (TypeError, ValueError):
            return None
        if op == ReduceOp.Adasum or not self._progress.acquire(blocking=False):
            return None
        entry = None
        claimed = False
        try:
            with self._lock:  # the name is ours until this call ends (see submit_many)
                if name in self._names_in_flight:
                    return None  # the usual path reports the clash
                self._names_in_flight.add(name)
                claimed = True
            # Under the progress lock: a round running elsewhere may be teaching the cache.
            number = self._cache.number_of(array.dtype, array.shape, op, postscale)
            if (number is None or self._pending or self._queue or self._failure is not None
                    or self._stopped):
                return None  # not agreed on yet, or another thread got here first
            self._driver_left_at = time.monotonic()  # the background thread stays parked
            riding = array.nbytes <= self.eager_bytes
            head = self._cache.head_one(number, name, riding)
            payload = head + array.tobytes() if riding else head
            flags = _IDLE if self.rank == 0 and self._idle(False) else 0
            negotiation = self._negotiation
            try:
                negotiation.exchange(payload, flags)
                self.cycles += 1
                agreed = negotiation.alike(head, len(payload))
                if agreed is not None and agreed & _IDLE:
                    # Every rank sent the same number and name: all reduce alike, the
                    # tensors that rode along here, a larger one on the backend.
                    out = array
                    if not inplace:
                        # A small result goes to a numpy caller: no pool, no alignment
                        # (the TensorFlow binding aligns what it adopts itself).
                        out = (np.empty if riding else OUTPUTS.empty)(array.shape, array.dtype)
                    if riding:
                        rows = negotiation.rows(len(head), array.dtype, array.size)
                        reduce_rows(rows, op, postscale, out=out.reshape(-1))
                    else:
                        if out is not array:
                            np.copyto(out, array)
                        self.comm.allreduce(SegmentedBuffer([out.reshape(-1)]), op)
                        finish_reduction(out, op, postscale, self.size)
                    self.cached_rounds += 1
                    self.express_rounds += 1
                    self.executed_responses += 1
                    self.executed_tensors += 1
                    self.executed_eager += riding
                    self._busy_since = time.monotonic()
                    return out
                self.express_fallbacks += 1
                entry = self._express_entry(name, array, op, postscale, inplace)
                self._resolve(negotiation.collect(payload))
            except BaseException as exc:  # noqa: BLE001 - as a waiting caller's _drive
                self._fail(exc)
                self._failed_while_driving()
                if entry is None:
                    raise self._error_for(name) from exc
        finally:
            if claimed and entry is None:
                with self._lock:
                    self._names_in_flight.discard(name)
            self._driver_left_at = time.monotonic()
            self._progress.release()
        return self.wait(entry.handle)

    def _express_entry(self, name: str, array: np.ndarray, op: int, postscale: float,
                       inplace: bool) -> Entry:
        """The entry a usual submission of an express allreduce would have made, pending
        (its request went out in the round already)."""
        payload = array.reshape(-1) if array.nbytes <= self.eager_bytes else None
        request = Request(name, m.ALLREDUCE, array.dtype.name, array.shape, int(op), 1.0,
                          float(postscale), payload=payload)
        if inplace:
            entry = Entry(request, Handle(name), array)
        else:
            entry = Entry(request, Handle(name), OUTPUTS.empty(array.shape, array.dtype),
                          source=array)
        with self._lock:  # the name is in flight already (claimed by express_allreduce)
            self._pending[name] = entry
        return entry

    def _driver_arrived(self) -> None:
        pass  # the background thread checks for drivers before each round

    def _drive(self, timeout: float) -> None:
        del timeout  # a round waits for the slowest rank, within the engine's deadline
        self._round()

    def _failed_while_driving(self) -> None:
        self._wakeup.set()  # the background thread sees the failure and closes

    def shutdown(self) -> None:
        """Leave the job: every rank's engine stops with this one (Horovod's behaviour)."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._wakeup.set()
        self._thread.join(self.config.timeout + BYE_WAIT_S)

    def abort(self, error: HvdSparkError) -> None:
        """Fail this rank's collectives now with ``error`` (from any thread)."""
        with self._lock:
            if self._failure is None:
                self._failure = error
        self.comm.abort()
        self._wakeup.set()

    # ------------------------------------------------------------------ engine thread

    def _parked(self) -> bool:
        return (self._failure is None and not self._stopping and not self._stopped
                and self._callers_drive())

    def _run(self) -> None:
        graceful = False
        try:
            while not self._stopped:
                if self._parked():
                    self._wakeup.wait(PARK_S)
                    self._wakeup.clear()
                    continue
                self._await_work()
                self._wakeup.clear()
                if self._parked():
                    continue  # a caller came meanwhile: it runs the round
                with self._progress:
                    self._round()
            graceful = True
        except BaseException as exc:  # noqa: BLE001 - every error fails the pending handles
            self._fail(exc)
        finally:
            with self._progress:
                self._close(graceful)

    def _round(self) -> None:
        """One negotiation round and its operations (sets ``_stopped`` when all stop)."""
        if self._failure is not None:
            raise self._failure
        if self._stopped:
            return
        with self._lock:
            new = list(self._queue)
            self._queue.clear()
            stopping = self._stopping
        shared = self._negotiation.share(self._message([e.request for e in new], stopping),
                                         _IDLE if self._idle(stopping) else 0)
        self.cycles += 1
        self._resolve(shared)

    def _resolve(self, shared: Shared) -> None:
        """The rest of a round once every rank's message is in: decide, run, or stop."""
        if shared.whole and shared.flags[0] & _IDLE:
            agreed = self._cache.agreed(shared.parts)
            if agreed is not None:
                # Every rank takes this branch: all hold the same parts and flags.
                self.cached_rounds += 1
                self._busy_since = time.monotonic()
                for response in self._cache.reduce(agreed, shared.parts):
                    self._execute(response)
                return
            if not any(shared.parts):
                self._busy_since = None  # rank 0 would answer nothing: no broadcast
                return
        answer = self._negotiation.answer(
            self._decide(shared.parts) if self.rank == 0 else None)
        if not answer:
            self._busy_since = None
            return
        responses, stop, labels = pickle.loads(answer)
        self._busy_since = time.monotonic() if responses else None
        for response, numbers in zip(responses, labels):
            if numbers:
                self._remember(response, numbers)
            self._execute(response)
        if stop is not None:
            self._stop(stop)
            self._stopped = True

    def _message(self, requests: list, stopping: bool) -> bytes:
        """This rank's part of a round: cached numbers when it can, else pickled."""
        if not requests and not stopping:
            return b""
        if not stopping:
            cached = self._cache.encode(requests)
            if cached is not None:
                return cached
        return PICKLED + pickle.dumps((requests, stopping))

    def _idle(self, stopping: bool) -> bool:
        """Rank 0: nothing in the coordinator's hands, nothing it must see (timeline,
        autotuner), so a round the ranks agree on may skip it."""
        coord = self._coordinator
        return (coord is not None and not stopping and not self._bye_since
                and not self.autotuning and timeline.current() is None
                and not coord.has_ready() and not coord.has_partial() and not coord.joined
                and not coord.departed and coord.next_chunk_bytes is None)

    def _remember(self, response, numbers: tuple[int, ...]) -> None:
        """Cache this rank's requests of an eager allreduce every rank runs now under
        the numbers rank 0 gave them."""
        with self._lock:
            requests = [self._pending[n].request for n in response.names if n in self._pending]
        if len(requests) == len(response.names):  # else _execute fails the engine anyway
            for number, request in zip(numbers, requests):
                self._cache.remember(number, request)

    def _labels(self, responses: list) -> list[tuple[int, ...] | None]:
        """Rank 0: the cache numbers of each response's tensors (None: not cached)."""
        labels: list[tuple[int, ...] | None] = []
        for response in responses:
            numbers = None
            if cacheable(response):
                with self._lock:
                    mine = [self._pending.get(n) for n in response.names]
                if all(e is not None for e in mine):
                    numbers = tuple(self._labeler.label(e.request) for e in mine)
            labels.append(numbers)
        return labels

    def _await_work(self) -> None:
        """Until a submission or the tick. Right after a busy cycle, first poll briefly
        (releasing the GIL each time): a training loop's next collective usually comes
        within microseconds, and waking a sleeping thread costs more than that."""
        if self._busy_since is not None:
            until = time.monotonic() + _LINGER_S
            while time.monotonic() < until:
                if self._queue or self._wakeup.is_set() or self._drivers:
                    return
                time.sleep(0)  # lets the caller's thread take the GIL to submit
        self._wakeup.wait(self._tick)

    # -- rank 0: the coordinator's side

    def _decide(self, parts: list[bytes]) -> bytes:
        coord = self._coordinator
        now = time.monotonic()
        tl = timeline.current()
        for rank, part in enumerate(parts):
            if not part:
                continue
            if part[:1] == PICKLED:
                requests, bye = pickle.loads(memoryview(part)[1:])
            else:
                requests, bye = self._cache.requests(part), False
            for request in requests:
                if tl is not None:
                    row = timeline_row(request.name, request.kind)
                    tl.negotiate_start(row, request.kind)
                    tl.negotiate_rank_ready(row, rank)
                coord.add(rank, request, now)
            if bye and rank not in self._bye_since:
                self._bye_since[rank] = now
                coord.depart(rank, "called shutdown()")
        if tl is not None:
            tl.mark_cycle()
        if coord.has_partial():
            # Some ranks are waiting for others' requests: be in the next round at once.
            self._wakeup.set()
        stop = self._stop_reason(now)
        responses = self._ready_responses(now) if stop is None else coord.take_responses()
        if not responses and stop is None:
            return b""
        return pickle.dumps((responses, stop, self._labels(responses)))

    def _stop_reason(self, now: float) -> str | None:
        if not self._bye_since:
            return None
        if len(self._bye_since) == self.size:
            return ""
        first_rank, first = min(self._bye_since.items(), key=lambda kv: kv[1])
        if now - first > BYE_WAIT_S:
            return (f"rank {first_rank} called shutdown() {BYE_WAIT_S:.0f} s ago; under MPI all "
                    "ranks stop together")
        return None

    def _ready_responses(self, now: float) -> list:
        coord = self._coordinator
        coord.police_stalls(now, self.config)
        if not coord.has_ready():
            return []
        if self._linger(coord, now) > 0:
            return []  # others are half submitted: they may fuse with these
        self._first_ready = None
        responses = coord.take_responses()
        self._taken(coord, responses)
        return responses

    def _stop(self, reason: str) -> None:
        """Every rank stops in the same cycle; a rank still working learns why."""
        with self._lock:
            if not self._stopping and self._failure is None:
                self._failure = CollectiveError(
                    reason or "another rank called shutdown(); no more collectives can run")

    def _fail(self, exc: BaseException) -> None:
        super()._fail(exc)
        log.debug("MPI engine on rank %d stopping: %s", self.rank, self._failure)
        # Peers blocked in a round with us must not wait for the timeout.
        self.mpi_comm.channel.send(f"rank {self.rank} failed: {self._failure}")

    def _close(self, graceful: bool) -> None:
        self._closed = True
        if graceful:
            self.mpi_comm.finish()  # nobody waits on us: no abort notices
        self.comm.close()
        self._fail_pending()
