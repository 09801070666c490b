"""N local processes as ranks of one job: ``run_local`` and the ``hvdrun`` CLI.

The launcher runs the authenticated rendezvous store, starts one process per rank
with its HVD_SPARK_* environment, prefixes their output with the rank, and, as soon
as any rank fails, stops the others and raises one error naming the root cause.
"""

from __future__ import annotations

import contextlib
import ctypes
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
from hvd_spark.errors import ConfigError, WorkerFailedError
from hvd_spark.runner import worker
from hvd_spark.runner.failures import WorkerFailure
from hvd_spark.runner.heartbeat_monitor import BEAT, HeartbeatMonitor
from hvd_spark.runner.output import OutputForwarder

_TEARDOWN_GRACE_S = 3.0
DEFAULT_HEARTBEAT_S = 10.0
_HOST = "localhost"


def pickle_job(fn: Callable, args: Sequence, kwargs: dict | None) -> bytes:
    """Pickle ``(fn, args, kwargs)`` or raise a ConfigError naming what is not picklable."""
    if not callable(fn):
        raise ConfigError(f"fn must be callable, got {type(fn).__name__}")
    for what, value in (("fn", fn), ("args", tuple(args)), ("kwargs", dict(kwargs or {}))):
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - re-raised with the culprit named
            raise ConfigError(
                f"{what} cannot be pickled to send to the workers: {exc}. Create such objects "
                "(sessions, locks, open files) inside fn instead of capturing them"
            ) from exc
    return cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))


def die_with_parent() -> None:
    # Linux: the kernel sends SIGTERM to the rank if the launcher dies.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def heartbeat_limit() -> float:
    """Seconds of silence after which a rank counts as lost (HVD_SPARK_HEARTBEAT_S)."""
    return _env.get_float(_env.HEARTBEAT, DEFAULT_HEARTBEAT_S)


def rank_env(rank: int, size: int, store_port: int, secret: bytes) -> dict[str, str]:
    """The variables of one local rank: ours, and Horovod's and torch's names for them."""
    return {
        **_env.rank_variables(rank, size, rank, size, 0, 1, socket.gethostname()),
        _env.RENDEZVOUS_ADDR: f"127.0.0.1:{store_port}",
        _env.SECRET: secret.hex(),
        _env.HEARTBEAT: str(heartbeat_limit()),
        "PYTHONUNBUFFERED": "1",
    }


class LocalJob:
    """One launch of N local ranks.

    Args:
        num_proc: Number of ranks.
        env: Extra environment variables for every rank.
        stdout, stderr: Streams receiving the ranks' prefixed output lines.
        bind_host: Interface the rendezvous store listens on (hosts other than this
            one need an address they can reach, e.g. "0.0.0.0").
    """

    def __init__(
        self,
        num_proc: int,
        env: dict[str, str] | None = None,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
        bind_host: str = "127.0.0.1",
    ) -> None:
        if not isinstance(num_proc, int) or num_proc < 1:
            raise ConfigError(f"num_proc must be a positive integer, got {num_proc!r}")
        self.num_proc = num_proc
        self.secret = secrets.token_bytes(32)
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.heartbeats = HeartbeatMonitor(heartbeat_limit(), self._on_silent)
        self.store = StoreServer(self.secret, bind_host, {
            worker.REPORT: self._on_report, BEAT: self.heartbeats.beat})
        self._env = dict(env or {})
        self._output = OutputForwarder(stdout or sys.stdout, stderr or sys.stderr)
        self.procs: list[subprocess.Popen] = []
        self.results: dict[int, bytes] = {}

    def host_of(self, rank: int) -> str:
        """The host rank ``rank`` runs on, as failures name it."""
        return _HOST

    def _on_report(self, rank: int, status: str, payload: Any) -> None:
        self._events.put(("report", rank, status, payload, time.time()))

    def _on_silent(self, rank: int, seconds: float) -> None:
        self._events.put(("silent", rank, seconds, None, time.time()))

    def start(self, command: Sequence[str]) -> None:
        """Start one process per rank running ``command``."""
        for rank in range(self.num_proc):
            env = {**os.environ, **self._env,
                   **rank_env(rank, self.num_proc, self.store.port, self.secret)}
            proc = subprocess.Popen(
                list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, preexec_fn=die_with_parent,
            )
            self.procs.append(proc)
            self._output.follow(rank, proc.stdout, proc.stderr)
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        self._events.put(("exit", rank, code, None, time.time()))

    def wait(self, expect_reports: bool) -> list[WorkerFailure]:
        """Wait for every rank to end; return the failures (empty on success)."""
        failures: dict[int, WorkerFailure] = {}
        exited: dict[int, int] = {}
        torn_down_at: float | None = None
        while len(exited) < self.num_proc:
            try:
                kind, rank, a, b, when = self._events.get(timeout=0.5)
            except queue.Empty:
                if torn_down_at is not None and time.time() - torn_down_at > _TEARDOWN_GRACE_S:
                    self._signal_all(signal.SIGKILL)
                continue
            if kind == "silent":
                failure = WorkerFailure(rank, self.host_of(rank), (
                    f"rank {rank} sent no heartbeat for {a:.0f} s: its process is frozen "
                    "(stopped, or stuck outside Python) or its host is unreachable"), lost=True)
                failures.setdefault(rank, failure)
                self.heartbeats.abort(failure.message)
            elif kind == "report":
                if a == "ok":
                    self.results[rank] = b
                else:
                    failures.setdefault(rank, b)
            else:
                exited[rank] = a
                self.heartbeats.forget(rank)
                unreported = expect_reports and rank not in self.results
                if rank not in failures and (a != 0 or unreported):
                    failures[rank] = WorkerFailure.from_exit(
                        rank, self.host_of(rank), a, torn_down=torn_down_at is not None)
            if failures and torn_down_at is None:
                torn_down_at = time.time()
                self._signal_all(signal.SIGTERM)
        self._drain_reports(failures)
        self._output.close()
        return list(failures.values())

    def _drain_reports(self, failures: dict[int, WorkerFailure]) -> None:
        # A report may arrive just after its process's exit event: prefer the report.
        while True:
            try:
                kind, rank, a, b, _ = self._events.get_nowait()
            except queue.Empty:
                return
            if kind == "report" and a == "error":
                failures[rank] = b
            elif kind == "report" and a == "ok":
                self.results[rank] = b

    def _signal_all(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)

    def close(self) -> None:
        """Kill anything still running, remove what killed ranks left, stop the store."""
        self._signal_all(signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(5)
        remove_segments(job_tag(self.secret))
        self.heartbeats.close()
        self.store.close()

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_local(
    fn: Callable,
    args: Sequence = (),
    kwargs: dict | None = None,
    num_proc: int | None = None,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` local ranks; results in rank order.

    Args:
        fn: The function each rank runs; it may call ``hvd_spark.collectives.init()``
            (or the torch/tensorflow bindings' ``init``).
        args, kwargs: Arguments passed to ``fn`` (pickled with cloudpickle).
        num_proc: Number of ranks (default: number of CPUs).
        env: Extra environment variables for the ranks.
        stdout, stderr: Streams receiving the ranks' output, each line prefixed ``[rank]``.

    Raises:
        WorkerFailedError: A rank failed; the others were stopped.
        ConfigError: Bad arguments, or something cannot be pickled.
    """
    num_proc = num_proc if num_proc is not None else (os.cpu_count() or 1)
    payload = pickle_job(fn, args, kwargs)
    with LocalJob(num_proc, env, stdout, stderr) as job:
        job.store.set(worker.FN_KEY, payload)
        job.start([sys.executable, "-m", "hvd_spark.runner.worker"])
        failures = job.wait(expect_reports=True)
        if failures:
            raise WorkerFailedError(failures)
        return [cloudpickle.loads(job.results[r]) for r in range(num_proc)]


def run_command(
    command: Sequence[str], num_proc: int, env: dict[str, str] | None = None
) -> list[WorkerFailure]:
    """Run ``command`` as ``num_proc`` ranks (the ``hvdrun`` CLI); return the failures."""
    with LocalJob(num_proc, env) as job:
        job.start(command)
        return job.wait(expect_reports=False)
