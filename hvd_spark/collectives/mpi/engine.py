"""The collectives engine of MPI jobs: negotiation rounds over MPI, as Horovod's MPI controller.

Every rank's background thread runs the same cycle: it sends the requests submitted
since the last cycle to rank 0 (``Negotiation.round``), rank 0's coordinator (the same
pure logic as the TCP engine's) answers with the responses to run, and every rank runs
them in that order on the ``MpiCommunicator``. A cycle starts as soon as a request is
submitted, or after the cycle time when idle (a rank joins its peers' cycles even when it
has nothing to ask). A shutdown on any rank ends the engine on every rank together, as
in Horovod; the others fail what they still submit, with the reason.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections import deque

from hvd_spark.collectives import messages as m
from hvd_spark.collectives import operations, timeline
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.coordinator import Coordinator
from hvd_spark.collectives.mpi.communicator import MpiCommunicator
from hvd_spark.collectives.mpi.negotiation import Negotiation
from hvd_spark.collectives.nccl import arrays
from hvd_spark.collectives.operations import Entry, Handle
from hvd_spark.config import EngineConfig
from hvd_spark.errors import (
    CollectiveArgumentError,
    CollectiveError,
    HorovodInternalError,
    HvdSparkError,
    PeerDisconnectedError,
)

log = logging.getLogger(__name__)

# After one rank's shutdown, how long the others may go on before all stop together.
BYE_WAIT_S = 10.0
# Idle cycles come at least this often (with a cycle time of 0, a busy loop otherwise).
_MIN_TICK_S = 0.5e-3
# After a cycle that ran something, how long to poll for the next submission.
_LINGER_S = 200e-6


def _row(name: str, kind: str) -> str:
    return name if name.startswith(kind) else f"{kind}.{name}"


class MpiEngine:
    """Runs one rank's collectives in a background thread, negotiating over MPI.

    Args:
        comm: The data communicator.
        negotiation: The control rounds (a communicator of their own).
        config: Fusion, cycle and timeout settings.
        routed: What runs the operations, when not ``comm`` itself (``comm`` wrapped so
            device buffers take a device path).
    """

    def __init__(self, comm: MpiCommunicator, negotiation: Negotiation,
                 config: EngineConfig, routed: Communicator | None = None) -> None:
        self.rank, self.size = comm.rank, comm.size
        self.mpi_comm = comm
        self.comm = routed or comm
        self.config = config
        self._negotiation = negotiation
        self._coordinator = Coordinator(self.size, config.fusion_threshold) if self.rank == 0 \
            else None
        self._tick = max(config.cycle_time_ms / 1000.0, _MIN_TICK_S)
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._queue: deque[Entry] = deque()
        self._pending: dict[str, Entry] = {}
        self._names_in_flight: set[str] = set()
        self._failure: BaseException | None = None
        self._stopping = False
        self._bye_since: dict[int, float] = {}  # rank 0: who said goodbye, when
        self._first_ready: float | None = None
        self._busy_since: float | None = None  # the last cycle that ran something
        self._subcomms: dict[tuple[int, ...], Communicator] = {}
        self.executed_responses = 0
        self.executed_tensors = 0
        self.cycles = 0
        self._thread = threading.Thread(target=self._run, name="hvd-engine-mpi", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side

    def submit(self, entry: Entry) -> Handle:
        """Queue an operation; returns its handle at once."""
        return self.submit_many([entry])[0]

    def submit_many(self, entries: list[Entry]) -> list[Handle]:
        """Queue operations as one batch (one negotiation round carries them all)."""
        names = [e.request.name for e in entries]
        with self._lock:
            if self._failure is not None:
                raise self._error_for(names[0])
            if self._stopping:
                raise CollectiveError(
                    f"collective {names[0]!r}: hvd_spark was shut down on this rank")
            clash = [n for n in names if n in self._names_in_flight]
            if clash or len(set(names)) != len(names):
                raise CollectiveArgumentError(
                    f"a collective named {(clash or names)[0]!r} is already in flight on rank "
                    f"{self.rank}; names must be unique until the operation completes")
            self._names_in_flight.update(names)
            for entry in entries:
                self._pending[entry.request.name] = entry
            self._queue.extend(entries)
        self._wakeup.set()
        return [e.handle for e in entries]

    def wait(self, handle: Handle):
        """Wait for ``handle`` with the engine's deadline."""
        return handle.wait(self.config.timeout + 30.0)

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

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the engine, if any."""
        return self._failure

    def _error_for(self, name: str) -> CollectiveError:
        cause = self._failure
        cls = (PeerDisconnectedError if isinstance(cause, PeerDisconnectedError)
               else HorovodInternalError)
        return cls(f"collective {name!r} cannot run: the collectives engine on rank {self.rank} "
                   f"stopped after an earlier failure: {cause}")

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        graceful = False
        try:
            while not self._cycle():
                pass
            graceful = True
        except BaseException as exc:  # noqa: BLE001 - every error fails the pending handles
            self._fail(exc)
        finally:
            self._close(graceful)

    def _cycle(self) -> bool:
        """One negotiation round and its operations; True when the engine stops."""
        self._await_work()
        self._wakeup.clear()
        if self._failure is not None:
            raise self._failure
        with self._lock:
            new = list(self._queue)
            self._queue.clear()
            stopping = self._stopping
        requests = [e.request for e in new]
        payload = pickle.dumps((requests, stopping)) if requests or stopping else b""
        answer = self._negotiation.round(payload, self._decide)
        self.cycles += 1
        if not answer:
            self._busy_since = None
            return False
        responses, stop = pickle.loads(answer)
        self._busy_since = time.monotonic() if responses else None
        for response in responses:
            self._execute(response)
        if stop is not None:
            self._stop(stop)
            return True
        return False

    def _await_work(self) -> None:
        """Until a submission or the tick. Right after a busy cycle, first poll briefly
        (releasing the GIL each time): a training loop's next collective usually comes
        within microseconds, and waking a sleeping thread costs more than that."""
        if self._busy_since is not None:
            until = time.monotonic() + _LINGER_S
            while time.monotonic() < until:
                if self._queue or self._wakeup.is_set():
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
            requests, bye = pickle.loads(part)
            for request in requests:
                if tl is not None:
                    row = _row(request.name, request.kind)
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
        return pickle.dumps((responses, stop))

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
        for name, missing in coord.stalled(now, self.config.stall_warning):
            log.warning(
                "collective %r has waited over %.0f s for ranks %s; they may be stuck or call "
                "collectives with other names", name, self.config.stall_warning, missing)
        limit = self.config.timeout
        if self.config.stall_shutdown > 0:
            limit = min(limit, self.config.stall_shutdown)
        coord.expire(now, limit)
        if not coord.has_ready():
            return []
        if coord.has_partial():
            # Others are half-submitted: linger up to the cycle time so they fuse with these.
            if self._first_ready is None:
                self._first_ready = now
            if now - self._first_ready < self.config.cycle_time_ms / 1000.0:
                return []
        self._first_ready = None
        return coord.take_responses()

    # -- every rank: running what rank 0 decided

    def _execute(self, response) -> None:
        members = response.members
        if members is not None and self.rank not in members:
            return
        with self._lock:
            entries = [self._pending.pop(n) for n in response.names if n in self._pending]
        if response.error:
            for entry in entries:
                self._complete(entry, error=CollectiveArgumentError(response.error))
            return
        if response.kind == m.JOIN:
            for entry in entries:
                self._complete(entry, result=response.result)
            return
        if len(entries) != len(response.names):
            if self.rank in response.joined and not entries:
                entries = [Entry(t, Handle(t.name), arrays.zeros(t.shape, t.dtype, t.device))
                           for t in response.templates or ()]
            else:
                raise CollectiveError(f"rank {self.rank} was told to run {response.names} it "
                                      "never submitted")
        tl = timeline.current() if self.rank == 0 else None
        trace = None
        if tl is not None:
            rows = [_row(n, response.kind) for n in response.names]
            tl.negotiate_end_all(rows)
            tl.start_all(rows, response.kind.upper())
            trace = lambda activity: tl.activity_start_all(rows, activity)  # noqa: E731
        try:
            results = operations.execute(self._comm_for(members), response, entries, trace)
            if tl is not None:
                tl.end_all(rows)
        except BaseException as exc:
            failure = exc if isinstance(exc, HvdSparkError) else CollectiveError(
                f"collective {response.names[0]!r} failed on rank {self.rank}: {exc!r}")
            for entry in entries:
                self._complete(entry, error=failure)
            raise
        self.executed_responses += 1
        self.executed_tensors += len(entries)
        for entry, result in zip(entries, results):
            self._complete(entry, result=result)

    def _comm_for(self, members: tuple[int, ...] | None) -> Communicator:
        if members is None:
            return self.comm
        comm = self._subcomms.get(members)
        if comm is None:
            comm = self._subcomms[members] = self.comm.subset(members)
        return comm

    def _complete(self, entry: Entry, result=None, error: BaseException | None = None) -> None:
        with self._lock:
            self._names_in_flight.discard(entry.request.name)
        if error is not None:
            entry.handle.set_error(error)
        else:
            entry.handle.set_result(result)

    def _stop(self, reason: str) -> None:
        """Every rank stops in the same cycle; a rank still working learns why."""
        with self._lock:
            if not self._stopping and self._failure is None:
                self._failure = CollectiveError(
                    reason or "another rank called shutdown(); no more collectives can run")

    def _fail(self, exc: BaseException) -> None:
        if not isinstance(exc, HvdSparkError):
            exc = CollectiveError(f"collectives engine on rank {self.rank} failed: {exc!r}")
        log.debug("MPI engine on rank %d stopping: %s", self.rank, exc)
        with self._lock:
            if self._failure is None:
                self._failure = exc
        # Peers blocked in a round with us must not wait for the timeout.
        self.mpi_comm.channel.send(f"rank {self.rank} failed: {exc}")

    def _close(self, graceful: bool) -> None:
        if graceful:
            self.mpi_comm.finish()  # nobody waits on us: no abort notices
        self.comm.close()
        with self._lock:
            if self._failure is None:
                self._failure = CollectiveError("hvd_spark.collectives was shut down")
            leftovers = list(self._pending.values())
            self._pending.clear()
            self._queue.clear()
        for entry in leftovers:
            self._complete(entry, error=self._error_for(entry.request.name))
