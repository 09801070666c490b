"""Elastic training on local processes: ``hvdrun --min-np/--max-np`` and ``run_elastic_local``.

The launcher starts ``num_proc`` workers, each with a stable worker id (its output is
prefixed with that id), and an :class:`ElasticDriver` that forms the ring's generations.
A worker that dies or falls silent is not fatal while ``min_np`` remain: the survivors
re-form the ring. After ``cooldown`` seconds a replacement starts in the freed slot (up
to ``max_np`` live workers) and joins the ring at the ranks' next ``commit()``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

import cloudpickle

from hvd_spark import _env
from hvd_spark.collectives.tcp.shm import job_tag, remove_segments
from hvd_spark.collectives.tcp.store import StoreServer
from hvd_spark.errors import ElasticJobError
from hvd_spark.runner import worker
from hvd_spark.runner.elastic.elastic_driver import ElasticDriver
from hvd_spark.runner.elastic.elastic_job import (
    FINISH_GRACE_S,
    ElasticJob,
    is_lost_peer_failure,
)
from hvd_spark.runner.failures import WorkerFailure
from hvd_spark.runner.output import OutputForwarder
from hvd_spark.runner.run_config import ElasticConfig
from hvd_spark.runner.tied_child import WORKER_COMMAND, start_tied

DEFAULT_COOLDOWN_S = 5.0


class ElasticLocalJob(ElasticJob):
    """One elastic launch of local worker processes.

    Args:
        settings: Sizes and deadlines of the job.
        env: Extra environment variables for every worker.
        cooldown: Seconds after a worker is lost before a replacement starts (``None``:
            never replace).
        stdout, stderr: Streams receiving the workers' prefixed output, and the
            launcher's own lines about membership.
    """

    def __init__(
        self,
        settings: ElasticConfig,
        env: dict[str, str] | None = None,
        cooldown: float | None = DEFAULT_COOLDOWN_S,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.num_proc = settings.num_proc
        self.command: list[str] = list(WORKER_COMMAND)
        self.cooldown = cooldown
        self.secret = secrets.token_bytes(32)
        self._stderr = stderr or sys.stderr
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.driver = ElasticDriver(settings, on_lost=self._stop_worker, on_event=self._say)
        self.store = StoreServer(self.secret, "127.0.0.1",
                                 {**self.driver.handlers(), worker.REPORT: self._on_report})
        self._env = dict(env or {})
        self._output = OutputForwarder(stdout or sys.stdout, self._stderr)
        self.procs: dict[str, subprocess.Popen] = {}
        self.exit_codes: dict[str, int] = {}
        self.failures: dict[str, WorkerFailure] = {}
        self._replace_at: list[float] = []

    # ------------------------------------------------------------------ workers

    def _say(self, line: str) -> None:
        self._stderr.write(f"hvdrun: {line}\n")
        self._stderr.flush()

    def _on_report(self, rank: int, status: str, payload: Any, worker_id: str = "?") -> None:
        self._events.put(("report", worker_id, (rank, status, payload)))

    def spawn(self) -> str:
        """Start one more worker; return its id."""
        worker_id = str(len(self.procs))
        host = socket.gethostname()
        env = {
            **os.environ, **self._env,
            _env.RENDEZVOUS_ADDR: f"127.0.0.1:{self.store.port}",
            _env.SECRET: self.secret.hex(),
            _env.ELASTIC: "1",
            _env.WORKER_ID: worker_id,
            _env.HOSTNAME: host,
            _env.ELASTIC_TIMEOUT: str(self.settings.elastic_timeout_s),
            _env.HEARTBEAT: str(self.settings.heartbeat_s),
            "PYTHONUNBUFFERED": "1",
        }
        for var in (_env.RANK, _env.SIZE):  # an elastic worker learns its rank by joining
            env.pop(var, None)
        self.driver.worker_started(worker_id, host)
        proc = start_tied(self.command, signal.SIGTERM, env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.procs[worker_id] = proc
        self._output.follow(int(worker_id), proc.stdout, proc.stderr)
        threading.Thread(target=self._watch, args=(worker_id, proc), daemon=True).start()
        return worker_id

    def _watch(self, worker_id: str, proc: subprocess.Popen) -> None:
        self._events.put(("exit", worker_id, proc.wait()))

    def _stop_worker(self, worker_id: str, reason: str) -> None:
        """The driver declared ``worker_id`` lost: make sure it is gone (a frozen process
        must not wake up later in a ring that moved on), and plan its replacement."""
        proc = self.procs.get(worker_id)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self.cooldown is not None:
            self._replace_at.append(time.monotonic() + self.cooldown)

    # ------------------------------------------------------------------ the Launcher

    def publish(self, payload: bytes) -> None:
        """Put the pickled function where the workers' ``worker`` fetches it."""
        self.store.set(worker.FN_KEY, payload)

    def start(self, command: Sequence[str] | None = None) -> None:
        """Start ``num_proc`` workers running ``command`` (default: the published function)."""
        if command is not None:
            self.command = list(command)
        for _ in range(self.settings.num_proc):
            self.spawn()

    def watch(self) -> list[WorkerFailure]:
        """Supervise the workers until the job ends; the failures of training itself (a
        rank raised, not a lost worker), the others stopped, or [] when it finished.

        Raises:
            ElasticJobError: The job could not continue; says what was lost and why.
        """
        finished_at: float | None = None
        while True:
            try:
                kind, worker_id, value = self._events.get(timeout=0.25)
            except queue.Empty:
                kind = None
            if kind is not None:
                self._apply(kind, worker_id, value)
            if self.failed:
                self.stop()
                return self.failed
            if self.driver.fatal:
                raise ElasticJobError(self.driver.fatal)
            self._start_due_replacements()
            if self.driver.finished:
                finished_at = finished_at or time.monotonic()
                running = [w for w in self.driver.members if self.procs[w].poll() is None]
                if not running or time.monotonic() - finished_at > FINISH_GRACE_S:
                    self._drain()
                    return self.failed

    def _apply(self, kind: str, worker_id: str, value: Any) -> None:
        if kind == "exit":
            self.exit_codes[worker_id] = value
            failed = self.failures.get(worker_id)
            if failed is not None and value != 0 and not is_lost_peer_failure(failed):
                self.failed.append(failed)
                return
            self.driver.worker_exited(worker_id, value)
            self._check_start(worker_id, value)
        elif kind == "report":
            rank, status, payload = value
            if status == "ok":
                self.results[worker_id] = (rank, payload)
            else:
                self.failures[worker_id] = payload

    def _drain(self) -> None:
        """Apply what arrived after the last member ended (a report just before its exit)."""
        while True:
            try:
                kind, worker_id, value = self._events.get_nowait()
            except queue.Empty:
                break
            if kind == "report":
                self._apply(kind, worker_id, value)
        # A member that reported a failure of training: the run failed with it.
        for worker_id, failure in self.failures.items():
            if worker_id in self.driver.members and not is_lost_peer_failure(failure) \
                    and failure not in self.failed:
                self.failed.append(failure)

    def _check_start(self, worker_id: str, returncode: int) -> None:
        """Before the first ring forms, too many early exits end the job at once (not
        after the start timeout): the command most likely fails on its own."""
        alive = len(self.driver.alive)
        if returncode != 0 and self.driver.generation == 0 and alive < self.settings.min_np:
            raise ElasticJobError(
                f"worker {worker_id} exited with code {returncode} before the first ring "
                f"formed, leaving {alive} live workers, fewer than min_np="
                f"{self.settings.min_np}; see its output above")

    def _start_due_replacements(self) -> None:
        now = time.monotonic()
        due = [t for t in self._replace_at if t <= now]
        if not due or self.driver.finished or self.driver.fatal:
            return
        self._replace_at = [t for t in self._replace_at if t > now]
        for _ in due:
            if len(self.driver.alive) < self.settings.max_np:
                worker_id = self.spawn()
                self._say(f"started worker {worker_id} to replace a lost one")

    def stop(self) -> None:
        """SIGTERM every worker's process group, SIGKILL what is left after the grace."""
        procs = [p for p in self.procs.values() if p.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
            deadline = time.monotonic() + self.settings.timeouts.stop_grace_s
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop every worker, the driver and the store; remove shared-memory leftovers."""
        self.driver.close()
        self.stop()
        self._output.close()
        remove_segments(job_tag(self.secret))
        self.store.close()


def run_elastic_local(
    fn: Callable,
    args: Sequence = (),
    kwargs: dict | None = None,
    num_proc: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    start_timeout: float | None = None,
    elastic_timeout: float | None = None,
    reset_limit: int | None = None,
    cooldown: float | None = DEFAULT_COOLDOWN_S,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> list:
    """Run ``fn`` elastically on local processes; results of the final ranks in rank order.

    ``fn`` should use ``hvd.elastic.run`` and a ``State`` to survive lost workers.
    """
    num_proc = num_proc if num_proc is not None else (os.cpu_count() or 1)
    settings = ElasticConfig.from_kwargs(num_proc, min_np, max_np, start_timeout,
                                         elastic_timeout, reset_limit, env)
    payload = worker.pickle_job(fn, args, kwargs)
    with ElasticLocalJob(settings, env, cooldown, stdout, stderr) as job:
        return [cloudpickle.loads(result) for result in job.run(payload)]
