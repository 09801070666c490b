"""The driver's side of one Spark run: an authenticated service the tasks talk to.

It wraps the collectives' ``StoreServer`` (so the ranks' rendezvous uses it too)
and adds request kinds for task registration, output lines, results and exits.
Everything the tasks send becomes an event ``(kind, rank or partition, value)`` on
one queue the launcher consumes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from hvd_spark import _env
from hvd_spark.collectives.tcp.store import StoreServer
from hvd_spark.errors import HvdSparkError, RendezvousTimeoutError
from hvd_spark.runner import worker
from hvd_spark.runner.failures import WorkerFailure
from hvd_spark.runner.gpu_mapping import place_gpus
from hvd_spark.runner.heartbeat_monitor import BEAT, HeartbeatMonitor
from hvd_spark.runner.output import OutputForwarder
from hvd_spark.runner.progress_events import PROGRESS
from hvd_spark.runner.rendezvous import RankInfo, TaskSlot, assign_ranks, with_master

REGISTER = "register"
LOG = "log"
EXIT = "exit"
TASK_ERROR = "task_error"
SHARE_ROWS = "share_rows"
STOP_KEY = "stop"

log = logging.getLogger("hvd_spark.runner")


class DriverService:
    """Registration, output, results and failures of one run's tasks.

    Args:
        num_proc: Number of tasks (ranks) expected to register.
        secret: The run's secret; every connection must prove it.
        bind_host: Interface to listen on.
        advertise_host: Address tasks dial to reach this service.
        output: Where the ranks' output lines go.
        progress: Receives the ranks' progress events ``(rank, event dict)``; None drops them.
    """

    def __init__(
        self,
        num_proc: int,
        secret: bytes,
        bind_host: str,
        advertise_host: str,
        output: OutputForwarder,
        progress: Callable[[int, dict], None] | None = None,
    ) -> None:
        self.num_proc = num_proc
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.first_registered_at: float | None = None
        self.all_registered_at: float | None = None
        self._output = output
        self._progress = progress
        self._advertise_host = advertise_host
        self._cond = threading.Condition()
        self._slots: dict[int, TaskSlot] = {}
        self._gpus: dict[int, tuple[str, ...]] = {}
        self._endpoints: dict[int, tuple[str, int] | None] = {}
        self._share_rows: dict[int, int] = {}
        self._assignment: dict[int, RankInfo] | None = None
        self._stopped = False
        self.server = StoreServer(secret, bind_host, {
            REGISTER: self._on_register,
            PROGRESS: self._on_progress,
            LOG: self._on_log,
            worker.REPORT: self._on_report,
            EXIT: self._on_exit,
            TASK_ERROR: self._on_task_error,
            SHARE_ROWS: self._on_share_rows,
            BEAT: self._on_beat,
        })
        self._heartbeats: HeartbeatMonitor | None = None

    @property
    def addr(self) -> str:
        """``host:port`` the tasks and their ranks dial."""
        return f"{self._advertise_host}:{self.server.port}"

    @property
    def registered(self) -> int:
        """How many tasks have registered so far."""
        with self._cond:
            return len(self._slots)

    @property
    def hosts(self) -> dict[int, str]:
        """Rank -> host, once every task has registered (empty before)."""
        with self._cond:
            return {i.rank: i.host for i in (self._assignment or {}).values()}

    @property
    def ranks(self) -> dict[int, RankInfo]:
        """Partition -> its rank, once every task has registered (empty before)."""
        with self._cond:
            return dict(self._assignment or {})

    def _on_register(self, partition: int, host: str, timeout: float,
                     gpus: tuple[str, ...] = (),
                     endpoint: tuple[str, int] | None = None) -> RankInfo:
        # Blocks the task until every task has registered, then returns its rank and, with
        # ``gpus`` (its Spark GPU addresses), its host's GPU order (gpu_mapping). Each task
        # brings ``endpoint``, its address and a port free on its host: rank 0's becomes
        # every rank's torch.distributed master (torch_world).
        with self._cond:
            if self._stopped:
                raise HvdSparkError("this run was already stopped; the task is not needed")
            if partition in self._slots or self._assignment is not None:
                raise HvdSparkError(
                    f"the task of partition {partition} registered twice (was it retried?); "
                    "a run is not restarted by Spark: call hvd_spark.run again")
            self._slots[partition] = TaskSlot(partition, host)
            self._gpus[partition] = tuple(gpus)
            self._endpoints[partition] = endpoint
            now = time.time()
            self.first_registered_at = self.first_registered_at or now
            if len(self._slots) == self.num_proc:
                self._assignment = with_master(place_gpus(
                    assign_ranks(list(self._slots.values())), self._gpus), self._endpoints)
                self.all_registered_at = now
                log.info("hvd_spark.run: ranks assigned: %s", ", ".join(
                    f"{i.rank} on {i.host} (local {i.local_rank}"
                    + (f", GPU {','.join(self._gpus[i.partition])}" if i.host_gpus else "")
                    + ")" for i in sorted(self._assignment.values(), key=lambda i: i.rank)))
                self._cond.notify_all()
            deadline = time.monotonic() + timeout
            while self._assignment is None and not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RendezvousTimeoutError(
                        f"only {len(self._slots)} of {self.num_proc} tasks registered within "
                        f"{timeout} s")
                self._cond.wait(left)
            if self._assignment is None:
                raise HvdSparkError("this run was stopped before every task registered")
            return self._assignment[partition]

    def _on_share_rows(self, partition: int, rows: int) -> None:
        # run(fn, df=...): a task wrote its share while its rank started. Once every task
        # has, the smallest share (each rank's batches per epoch), or why no rank can
        # train, goes to the ranks, which wait for it before they read (RankShare).
        with self._cond:
            self._share_rows[partition] = rows
            if len(self._share_rows) < self.num_proc:
                return
            rows_by = dict(self._share_rows)
        least = min(rows_by.values())
        if least > 0:
            self.server.set(_env.SHARE_MIN_ROWS_KEY, ("ok", least))
            return
        # Imported here: tasks import this module, and the data layer's writer (pyspark,
        # pandas) would cost each of them ~0.25 s.
        from hvd_spark.data.shares import empty_share_message

        self.server.set(_env.SHARE_MIN_ROWS_KEY,
                        ("error", empty_share_message(rows_by, self.num_proc)))

    def _on_log(self, rank: int, lines: list[tuple[str, str]]) -> None:
        for stream, line in lines:
            self._output.write(rank, stream, line)

    def _on_progress(self, rank: int, event: dict) -> None:
        if self._progress is not None and event.get("kind") != "hello":
            try:
                self._progress(rank, event)
            except Exception:  # noqa: BLE001 - drawing must never fail the run
                log.debug("progress display failed", exc_info=True)

    def _on_report(self, rank: int, status: str, payload: Any) -> None:
        self.events.put(("report", rank, (status, payload)))

    def _on_exit(self, rank: int, returncode: int, stopped: bool) -> None:
        # stopped: the task killed its rank because the driver said stop.
        self.events.put(("exit", rank, (returncode, stopped)))

    def _on_task_error(self, partition: int, failure: WorkerFailure) -> None:
        self.events.put(("task_error", partition, failure))

    def watch_heartbeats(self, limit: float) -> None:
        """Declare a rank lost after ``limit`` s without a heartbeat (event ``silent``)."""
        if limit > 0 and self._heartbeats is None:
            self._heartbeats = HeartbeatMonitor(
                limit, lambda rank, seconds: self.events.put(("silent", rank, seconds)))

    def _on_beat(self, worker: str, generation: int) -> str | None:
        monitor = self._heartbeats
        return monitor.beat(worker, generation) if monitor is not None else None

    def abort_ranks(self, reason: str) -> None:
        """Answer every rank's next heartbeat with ``reason``: their collectives fail now."""
        if self._heartbeats is not None:
            self._heartbeats.abort(reason)

    def set(self, key: str, value: Any) -> None:
        """Publish a value the ranks can fetch (e.g. the pickled function)."""
        self.server.set(key, value)

    def stop(self) -> None:
        """Tell every task to stop its rank; pending registrations fail."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self.server.set(STOP_KEY, True)

    def close(self) -> None:
        """Stop the tasks (if still running) and the server."""
        self.stop()
        if self._heartbeats is not None:
            self._heartbeats.close()
        self.server.close()

    def __enter__(self) -> DriverService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
