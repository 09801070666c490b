"""What every collectives engine shares: the caller-side bookkeeping, running agreed
responses, and progress made by the thread that waits.

An engine (``TcpEngine``, ``MpiEngine``) negotiates in its own way; this base class
holds the rest. Callers submit named entries and wait on handles. A caller that waits
does not hand the work to the background thread and sleep: it takes the progress lock
and runs the engine's cycle itself until its operation completes. On a small message
that saves two thread hand-offs per call (each costs tens of microseconds in CPython:
the woken thread must also win the GIL). The background thread keeps operations moving
while nobody waits (asynchronous operations overlapping compute), and stands aside
while a caller drives.
"""

from __future__ import annotations

import abc
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from hvd_spark.collectives import autotune, operations, timeline
from hvd_spark.collectives import messages as m
from hvd_spark.collectives.communicator import Communicator, caller_waiting
from hvd_spark.collectives.coordinator import Coordinator
from hvd_spark.collectives.operations import Entry, Handle
from hvd_spark.config import EngineConfig
from hvd_spark.errors import (
    CollectiveArgumentError,
    CollectiveError,
    HorovodInternalError,
    HvdSparkError,
    PeerDisconnectedError,
)

# A waiting caller runs the cycle in slices this long, so another waiting thread (or
# the background thread, for async work) gets its turn between them.
DRIVE_SLICE_S = 0.05
# While callers drive, and this long after the last left, the background thread stands
# aside; it re-checks this often (the latest an unwaited async operation starts then).
PARK_S = 2e-3
# Slack over the collective timeout before a waiter gives up on its own.
WAIT_SLACK_S = 30.0


def timeline_row(name: str, kind: str) -> str:
    """A tensor's timeline row, named as Horovod's are: ``<kind>.<name>``."""
    return name if name.startswith(kind) else f"{kind}.{name}"


# Request.device -> zeros(shape, dtype) there. The host's is here; a device path adds its
# own when imported (``nccl.arrays``), so this core imports no backend.
_ZEROS: dict[str, Callable[[tuple[int, ...], Any], Any]] = {"cpu": np.zeros}


def register_zeros(device: str, zeros: Callable[[tuple[int, ...], Any], Any]) -> None:
    """Let joined ranks make stand-in zeros on ``device`` (see ``zeros_entry``)."""
    _ZEROS[device] = zeros


def zeros_entry(template: m.Request) -> Entry:
    """A joined rank's stand-in for an allreduce it never submitted: zeros of that shape."""
    zeros = _ZEROS.get(template.device)
    if zeros is None:
        raise CollectiveError(
            f"collective {template.name!r} runs on {template.device!r} tensors, which this "
            "rank has no path for")
    return Entry(template, Handle(template.name), zeros(template.shape, template.dtype))


def apply_eager(response: m.Response, entries: list[Entry]) -> list:
    """Results of an allreduce rank 0 reduced during negotiation: copy each entry's part
    of the response's data (the entries' results one after another) out."""
    data = response.data
    if not isinstance(data, np.ndarray):
        data = np.frombuffer(data, entries[0].array.dtype)
    data = data.reshape(-1)
    if data.size != sum(e.array.size for e in entries):
        raise CollectiveError(f"the result of {list(response.names)} from rank 0 has "
                              f"{data.size} elements, not what the tensors hold")
    results, offset = [], 0
    for entry in entries:
        flat = entry.array.reshape(-1)
        np.copyto(flat, data[offset : offset + flat.size], casting="no")
        offset += flat.size
        entry.source = None
        results.append(entry.finish(entry.array))
    return results


class EngineCore(abc.ABC):
    """The shared half of an engine; subclasses negotiate and own the background thread.

    Subclasses call ``_execute`` for each response in the agreed order and implement
    ``_drive`` (one slice of progress from a waiting caller's thread).

    Args:
        rank, size: This rank and the world size.
        comm: The backend that moves the bytes.
        config: Fusion, cycle, eager and timeout settings.
    """

    def __init__(self, rank: int, size: int, comm: Communicator, config: EngineConfig) -> None:
        self.rank, self.size = rank, size
        self.comm = comm
        self.config = config
        #: Allreduces up to this many bytes travel with their negotiation messages (a
        #: synchronous one up to ``lone_eager_bytes``; rank 0 takes either).
        self.eager_bytes = config.eager_limit(size)
        self.lone_eager_bytes = config.eager_limit(size, lone=True)
        #: Broadcasts and allgathers up to this many bytes carry their tensors on their
        #: requests, for an engine whose two ranks decide them alone (``pairing``).
        self.paired_gather_bytes = 0
        self._lock = threading.Lock()  # guards the tables below (short holds only)
        # Held by whichever thread runs the engine's cycle: the background thread or a
        # waiting caller. Everything the cycle touches is used under it.
        self._progress = threading.Lock()
        self._drivers = 0  # callers waiting in wait() right now (under _lock)
        self._driver_left_at = 0.0
        self._queue: deque[Entry] = deque()
        self._pending: dict[str, Entry] = {}
        self._names_in_flight: set[str] = set()
        self._failure: BaseException | None = None
        self._stopping = False
        self._closed = False
        self._subcomms: dict[tuple[int, ...], Communicator] = {}
        #: Responses executed and tensors they covered; fused allreduces make these differ.
        self.executed_responses = 0
        self.executed_tensors = 0
        #: Of those responses, allreduces rank 0 reduced during negotiation.
        self.executed_eager = 0
        #: Rank 0's fusion wait; the autotuner may change it (the config stays as set).
        self.cycle_time_ms = config.cycle_time_ms
        self._first_ready: float | None = None  # rank 0: since when responses are ready
        #: The ring chunk size the responses have set (rank 0's view, for the autotuner).
        self.chunk_bytes = config.chunk_bytes
        self._tuner: autotune.Autotuner | None = None
        #: Rank 0 with autotuning on: the parameters the tuner froze (None until then).
        self.autotune_choice: autotune.Params | None = None

    @property
    def autotuning(self) -> bool:
        """True while rank 0's autotuner is still measuring."""
        return self._tuner is not None

    def _start_autotune(self, coordinator: Coordinator | None) -> None:
        """Rank 0 with autotuning on: tune from the responses ``coordinator`` takes.

        Subclasses call this once their coordinator exists. The chunk size is tuned
        where the backend can change it mid-run (``Communicator.tunes_chunks``).
        """
        tune = self.config.autotune
        if coordinator is None or tune is None:
            return
        start = autotune.Params(coordinator.fusion_threshold, self.cycle_time_ms,
                                self.config.chunk_bytes)
        self._tuner = autotune.Autotuner(tune, start, tune.fixed,
                                         tune_chunk=self.comm.tunes_chunks)
        autotune.log.info("autotune on (%s): tuning %s from %s", type(self).__name__,
                          ", ".join(k for k, g in self._tuner.search.grids.items()
                                    if len(g) > 1) or "nothing", start.describe())

    def _linger(self, coordinator: Coordinator, now: float) -> float:
        """Rank 0: seconds to keep gathering before sending the ready responses.

        A lone operation goes at once; only while other operations are half submitted
        does the coordinator linger (up to the cycle time) to fuse them. The caller
        resets ``_first_ready`` when it takes the responses.
        """
        if not coordinator.has_partial():
            return 0.0
        if self._first_ready is None:
            self._first_ready = now
        return max(0.0, self.cycle_time_ms / 1000.0 - (now - self._first_ready))

    def _taken(self, coordinator: Coordinator, responses: list[m.Response]) -> None:
        """Rank 0, after ``coordinator.take_responses()``: let the autotuner measure, and
        apply what it switches to (the chunk travels with the next responses)."""
        tuner = self._tuner
        if tuner is None or not responses:
            return
        names = [n for r in responses for n in r.names]
        params = tuner.observe(names, coordinator.taken_bytes, time.monotonic())
        if tuner.done:
            self._tuner = None  # nothing more to measure: a long run pays nothing after
            self.autotune_choice = tuner.search.best
        if params is None:
            return
        autotune.log.debug("autotune trying %s", params.describe())
        coordinator.fusion_threshold = params.fusion_threshold
        self.cycle_time_ms = params.cycle_time_ms
        if params.chunk_bytes != self.chunk_bytes:  # never, where the chunk is not tuned
            self.chunk_bytes = coordinator.next_chunk_bytes = params.chunk_bytes

    # ------------------------------------------------------------------ caller side

    def submit(self, entry: Entry) -> Handle:
        """Queue an operation; returns its handle at once."""
        return self.submit_many([entry])[0]

    def submit_many(self, entries: list[Entry]) -> list[Handle]:
        """Queue operations as one batch, so the coordinator sees (and fuses) them together."""
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
                    f"{self.rank}; names must be unique until the operation completes"
                )
            self._names_in_flight.update(names)
            for entry in entries:
                self._pending[entry.request.name] = entry
            if self._queues_locally():
                self._queue.extend(entries)
        self._submitted(entries)
        return [e.handle for e in entries]

    def express_allreduce(self, name: str, array: np.ndarray, op: int, postscale: float,
                          inplace: bool) -> np.ndarray | None:
        """Run a synchronous allreduce by a shorter path when the engine has one (see
        ``MpiEngine.express_allreduce``); None: submit it as usual, under ``name``."""
        del name, array, op, postscale, inplace
        return None

    def express_broadcast(self, name: str, array: np.ndarray, root: int,
                          inplace: bool) -> np.ndarray | None:
        """Run a synchronous broadcast by a shorter path when the engine has one (see
        ``tcp.express_moves``); None: submit it as usual, under ``name``."""
        del name, array, root, inplace
        return None

    def express_allgather(self, name: str, array: np.ndarray) -> np.ndarray | None:
        """Run a synchronous allgather by a shorter path when the engine has one (see
        ``tcp.express_moves``); None: submit it as usual, under ``name``."""
        del name, array
        return None

    def _queues_locally(self) -> bool:
        """True when submissions wait in ``_queue`` for the cycle (else ``_submitted``
        sends them on)."""
        return True

    @abc.abstractmethod
    def _submitted(self, entries: list[Entry]) -> None:
        """After ``entries`` were recorded: notify whoever negotiates them."""

    def wait(self, handle: Handle, timeout: float | None = None):
        """Wait for ``handle``, making progress on this thread; the engine's deadline
        applies, or ``timeout`` seconds when given (a ``CollectiveTimeoutError`` then;
        under MPI a negotiation round this thread began runs to its end first, which the
        engine's deadline bounds).

        Returns:
            The operation's result (raises its error).
        """
        limit = self.config.timeout + WAIT_SLACK_S if timeout is None else timeout
        deadline = time.monotonic() + limit
        if not handle.done():
            with self._lock:
                self._drivers += 1
            self._driver_arrived()
            try:
                self._drive_until(handle, deadline)
            finally:
                with self._lock:
                    self._drivers -= 1
                    self._driver_left_at = time.monotonic()
        return handle.wait(max(0.0, deadline - time.monotonic()), waited=limit)

    def _drive_until(self, handle: Handle, deadline: float) -> None:
        while not handle.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if not self._progress.acquire(timeout=min(left, DRIVE_SLICE_S)):
                continue
            try:
                if handle.done():
                    return
                if self._closed or self._failure is not None:
                    break  # the background thread is failing the handles: just wait
                try:
                    with caller_waiting():
                        self._drive(min(left, DRIVE_SLICE_S))
                except BaseException as exc:  # noqa: BLE001 - fails every pending handle
                    self._fail(exc)
                    self._failed_while_driving()
                    break
            finally:
                self._progress.release()
        handle.wait_done(max(0.0, deadline - time.monotonic()))

    @abc.abstractmethod
    def _driver_arrived(self) -> None:
        """A caller started waiting (hook: stand the background thread aside)."""

    def _callers_drive(self) -> bool:
        """Whether the background thread should stand aside: a caller drives now, or
        one left under ``PARK_S`` ago (a training loop's next synchronous call comes soon).
        """
        return bool(self._drivers) or time.monotonic() - self._driver_left_at < PARK_S

    @abc.abstractmethod
    def _drive(self, timeout: float) -> None:
        """One slice of progress on the caller's thread, at most ``timeout`` s blocked
        (called with the progress lock held)."""

    @abc.abstractmethod
    def _failed_while_driving(self) -> None:
        """A driving caller hit an engine failure (hook: tell the background thread)."""

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the engine, if any."""
        return self._failure

    def _error_for(self, name: str) -> CollectiveError:
        cause = self._failure
        cls = (PeerDisconnectedError if isinstance(cause, PeerDisconnectedError)
               else HorovodInternalError)
        return cls(
            f"collective {name!r} cannot run: the collectives engine on rank {self.rank} stopped "
            f"after an earlier failure: {cause}"
        )

    # ------------------------------------------------------------------ running responses

    def _timeline(self) -> timeline.Timeline | None:
        """The timeline to record into: rank 0 writes it."""
        return timeline.current() if self.rank == 0 else None

    def _execute(self, response: m.Response) -> None:
        """Run one agreed response on this rank and complete its entries' handles."""
        if response.chunk_bytes is not None:
            # Before the membership check: every rank switches at the same response.
            self.comm.set_chunk_bytes(response.chunk_bytes)
        members = response.members
        if members is not None and self.rank not in members:
            return  # another process set's operation
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
                entries = [zeros_entry(t) for t in response.templates or ()]
            else:
                missing = [n for n in response.names
                           if n not in {e.request.name for e in entries}]
                raise CollectiveError(
                    f"rank {self.rank} was told to run {missing} it never submitted")
        tl = self._timeline()
        trace = None
        if tl is not None:
            rows = [timeline_row(n, response.kind) for n in response.names]
            tl.negotiate_end_all(rows)
            tl.start_all(rows, response.kind.upper())
            tl.activity_start_all(rows, timeline.QUEUE)  # until the first phase begins
            trace = lambda activity: tl.activity_start_all(rows, activity)  # noqa: E731
        try:
            if response.data is not None:
                if trace is not None:
                    trace(timeline.EAGER_ALLREDUCE)
                results = apply_eager(response, entries)
            else:
                results = operations.execute(self._comm_for(members), response, entries, trace)
            if tl is not None:
                tl.end_all(rows)
        except BaseException as exc:
            # These entries left _pending already: complete them here with the real error,
            # or their callers would wait for the timeout.
            failure = exc if isinstance(exc, HvdSparkError) else CollectiveError(
                f"collective {response.names[0]!r} failed on rank {self.rank}: {exc!r}")
            if self._failure is not None:  # aborted: the reason beats the socket error
                failure = self._error_for(response.names[0])
            for entry in entries:
                self._complete(entry, error=failure)
            raise
        self.executed_responses += 1
        self.executed_tensors += len(entries)
        self.executed_eager += response.data is not None
        for entry, result in zip(entries, results):
            self._complete(entry, result=result)

    def _comm_for(self, members: tuple[int, ...] | None) -> Communicator:
        """The communicator of a process set (made at its first operation, then kept)."""
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

    def _fail(self, exc: BaseException) -> None:
        """Record the engine's failure (the first reason stays) and fail what is pending."""
        if not isinstance(exc, HvdSparkError):
            exc = CollectiveError(f"collectives engine on rank {self.rank} failed: {exc!r}")
        with self._lock:
            if self._failure is None:  # an abort's reason stays the reason
                self._failure = exc
        self._fail_pending()

    def _fail_pending(self) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = CollectiveError("hvd_spark.collectives was shut down")
            entries = list(self._pending.values())  # queued entries are pending too
            self._pending.clear()
            self._queue.clear()
        for entry in entries:
            self._complete(entry, error=self._error_for(entry.request.name))
