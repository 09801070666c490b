"""The background thread that negotiates, fuses and runs collectives.

Callers enqueue named requests and get handles. Rank 0's engine coordinates: the
others send it their requests over their control sockets; once every rank asked
for a name (and they agree), it sends the same ordered response list to all, and
every rank runs it on the backend. So ranks may issue operations in any order,
and a disagreement becomes an error on every rank instead of a hang.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections import deque

from hvd_spark.collectives import messages as m
from hvd_spark.collectives import operations, timeline
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.coordinator import Coordinator
from hvd_spark.collectives.nccl import arrays
from hvd_spark.collectives.operations import Entry, Handle
from hvd_spark.collectives.tcp import wire
from hvd_spark.config import EngineConfig
from hvd_spark.errors import (
    CollectiveArgumentError,
    CollectiveError,
    HorovodInternalError,
    HvdSparkError,
    PeerDisconnectedError,
)

log = logging.getLogger(__name__)

_IDLE_POLL_S = 1.0
_BYE_WAIT_S = 10.0
_ABORT_SEND_S = 1.0


def _row(name: str, kind: str) -> str:
    """A tensor's timeline row, named as Horovod's are: ``<kind>.<name>``."""
    return name if name.startswith(kind) else f"{kind}.{name}"


def _zeros_entry(template) -> Entry:
    """A joined rank's stand-in for an allreduce it never submitted: zeros of that shape."""
    return Entry(template, Handle(template.name),
                 arrays.zeros(template.shape, template.dtype, template.device))


class Engine:
    """Runs one rank's collectives in a background thread.

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
        self.rank, self.size = rank, size
        self.comm = comm
        self.config = config
        self._control = dict(control)
        self._sock_rank = {s.fileno(): r for r, s in self._control.items()}
        self._coordinator = Coordinator(size, config.fusion_threshold) if rank == 0 else None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._queue: deque[Entry] = deque()
        self._pending: dict[str, Entry] = {}
        self._names_in_flight: set[str] = set()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._failure: BaseException | None = None
        self._stopping = False
        self._bye_from: set[int] = set()
        self._first_ready: float | None = None
        self._subcomms: dict[tuple[int, ...], Communicator] = {}
        #: Responses executed and tensors they covered; fused allreduces make these differ.
        self.executed_responses = 0
        self.executed_tensors = 0
        self._thread = threading.Thread(target=self._run, name="hvd-engine", daemon=True)
        self._thread.start()

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
            if self._coordinator is not None:
                self._queue.extend(entries)
        if self._coordinator is not None:
            self._wake()
        else:
            self._send_requests(entries)
        return [e.handle for e in entries]

    def _send_requests(self, entries: list[Entry]) -> None:
        """Tell the coordinator straight from the caller's thread: one hop less per op."""
        try:
            with self._send_lock:
                wire.send_obj(self._control[0], ("req", [e.request for e in entries]), "rank 0")
        except HvdSparkError as exc:
            with self._lock:
                for entry in entries:
                    self._pending.pop(entry.request.name, None)
                    self._names_in_flight.discard(entry.request.name)
                if self._failure is None:
                    self._failure = exc
            raise self._error_for(entries[0].request.name) from exc

    def wait(self, handle: Handle):
        """Wait for ``handle`` with the engine's deadline."""
        return handle.wait(self.config.timeout + 30.0)

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

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the engine, if any."""
        return self._failure

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _error_for(self, name: str) -> CollectiveError:
        cause = self._failure
        cls = (PeerDisconnectedError if isinstance(cause, PeerDisconnectedError)
               else HorovodInternalError)
        return cls(
            f"collective {name!r} cannot run: the collectives engine on rank {self.rank} stopped "
            f"after an earlier failure: {cause}"
        )

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while True:
                if self._stopping and not self._queue:
                    self._leave()
                    return
                self._cycle()
        except BaseException as exc:  # noqa: BLE001 - every error fails the pending handles
            self._fail(exc)
            self._tell_others(self._failure)
        finally:
            self._close()

    def _tell_others(self, failure: BaseException | None) -> None:
        """Rank 0: pass the reason it stopped to every rank before closing, so they fail
        with the root cause ("rank 1 disconnected") instead of "rank 0 disconnected"."""
        if self._coordinator is None or not isinstance(failure, PeerDisconnectedError):
            return
        for peer, sock in self._control.items():
            try:
                sock.settimeout(_ABORT_SEND_S)
                with self._send_lock:
                    wire.send_obj(sock, ("abort", str(failure)), f"rank {peer}")
            except (HvdSparkError, OSError):
                pass  # that peer is gone too, or stuck: closing tells it anyway

    def _cycle(self) -> None:
        timeout = _IDLE_POLL_S
        if self._coordinator is not None and self._coordinator.has_ready():
            timeout = self._cycle_remaining()
        readable, _, _ = select.select([self._wake_r, *self._control.values()], [], [], timeout)
        new = self._drain_local()
        tl = timeline.current() if self._coordinator is not None else None
        if tl is not None:
            tl.mark_cycle()
            for entry in new:
                tl.negotiate_start(_row(entry.request.name, entry.request.kind),
                                   entry.request.kind)
        if self._coordinator is not None:
            now = time.monotonic()
            for entry in new:
                self._coordinator.add(self.rank, entry.request, now)
        for sock in readable:
            if sock is not self._wake_r:
                self._on_control(self._sock_rank[sock.fileno()], sock)
        if self._coordinator is not None:
            self._coordinate()

    def _drain_local(self) -> list[Entry]:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        with self._lock:
            new = list(self._queue)
            self._queue.clear()
        return new

    def _on_control(self, peer: int, sock: socket.socket) -> None:
        what = f"rank {peer}"
        try:
            kind, payload = wire.recv_obj(sock, what)
        except PeerDisconnectedError:
            raise PeerDisconnectedError(
                f"rank {peer} disconnected (it exited or was killed) while rank {self.rank} "
                f"was still running; see rank {peer}'s log for its error"
            ) from None
        if kind == "req":
            now = time.monotonic()
            tl = timeline.current()
            for request in payload:
                if tl is not None:
                    row = _row(request.name, request.kind)
                    tl.negotiate_start(row, request.kind)
                    tl.negotiate_rank_ready(row, peer)
                self._coordinator.add(peer, request, now)
        elif kind == "resp":
            for response in payload:
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
        return max(0.0, self.config.cycle_time_ms / 1000.0 - waited)

    def _coordinate(self) -> None:
        coord = self._coordinator
        now = time.monotonic()
        for name, missing in coord.stalled(now, self.config.stall_warning):
            log.warning(
                "collective %r has waited over %.0f s for ranks %s; they may be stuck or call "
                "collectives with other names", name, self.config.stall_warning, missing)
        # HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: give up on a stalled tensor sooner than the timeout.
        limit = self.config.timeout
        if self.config.stall_shutdown > 0:
            limit = min(limit, self.config.stall_shutdown)
        coord.expire(now, limit)
        if not coord.has_ready() or self._cycle_remaining() > 0:
            return
        self._first_ready = None
        responses = coord.take_responses()
        for peer, sock in self._control.items():
            wire.send_obj(sock, ("resp", responses), f"rank {peer}")
        for response in responses:
            self._execute(response)

    def _execute(self, response) -> None:
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
                entries = [_zeros_entry(t) for t in response.templates or ()]
            else:
                missing = [n for n in response.names
                           if n not in {e.request.name for e in entries}]
                raise CollectiveError(
                    f"rank {self.rank} was told to run {missing} it never submitted")
        tl = timeline.current() if self._coordinator is not None else None
        trace = None
        if tl is not None:
            rows = [_row(n, response.kind) for n in response.names]
            tl.negotiate_end_all(rows)
            tl.start_all(rows, response.kind.upper())
            tl.activity_start_all(rows, timeline.QUEUE)  # until the first phase begins
            trace = lambda activity: tl.activity_start_all(rows, activity)  # noqa: E731
        try:
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

    def _leave(self) -> None:
        """Graceful exit: everyone says bye to rank 0, which releases all once all did."""
        if self.size == 1:
            return
        try:
            if self._coordinator is None:
                with self._send_lock:
                    wire.send_obj(self._control[0], ("bye", None), "rank 0")
                self._wait_for(lambda: 0 in self._bye_from)
            else:
                self._wait_for(lambda: len(self._bye_from) == self.size - 1)
                for peer, sock in self._control.items():
                    wire.send_obj(sock, ("bye", None), f"rank {peer}")
        except HvdSparkError as exc:
            log.debug("rank %d left without a clean goodbye: %s", self.rank, exc)

    def _wait_for(self, condition) -> None:
        deadline = time.monotonic() + _BYE_WAIT_S
        while not condition():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            readable, _, _ = select.select(list(self._control.values()), [], [], left)
            for sock in readable:
                peer = self._sock_rank[sock.fileno()]
                kind, _ = wire.recv_obj(sock, f"rank {peer}")
                if kind == "bye":
                    self._bye_from.add(peer)

    def _fail(self, exc: BaseException) -> None:
        if not isinstance(exc, HvdSparkError):
            exc = CollectiveError(f"collectives engine on rank {self.rank} failed: {exc!r}")
        log.debug("engine on rank %d stopping: %s", self.rank, exc)
        with self._lock:
            if self._failure is None:  # an abort's reason stays the reason
                self._failure = exc
            entries = list(self._pending.values())  # queued entries are pending too
            self._pending.clear()
            self._queue.clear()
        for entry in entries:
            self._complete(entry, error=self._error_for(entry.request.name))

    def _close(self) -> None:
        # Closing our sockets makes every peer blocked on us fail at once, not at a timeout.
        self.comm.close()
        for sock in [*self._control.values(), self._wake_r, self._wake_w]:
            try:
                sock.close()
            except OSError:
                pass
        with self._lock:
            if self._failure is None:
                self._failure = CollectiveError("hvd_spark.collectives was shut down")
            leftovers = list(self._pending.values())
            self._pending.clear()
            self._queue.clear()
        for entry in leftovers:
            self._complete(entry, error=self._error_for(entry.request.name))
