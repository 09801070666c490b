"""N local processes as ranks of one job: ``run_local`` and the ``hvdrun`` CLI.

The launcher runs the authenticated rendezvous store, starts one process per rank
with its HVD_SPARK_* environment, prefixes their output with the rank, and, as soon
as any rank fails, stops the others and raises one error naming the root cause.
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
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import cloudpickle

from hvd_spark import _env
from hvd_spark.collectives.tcp.shm import job_tag, remove_segments
from hvd_spark.collectives.tcp.store import StoreServer
from hvd_spark.errors import ConfigError, WorkerFailedError
from hvd_spark.runner import torch_world, worker
from hvd_spark.runner.failures import WorkerFailure
from hvd_spark.runner.heartbeat_monitor import BEAT, HeartbeatMonitor, hearing_grace
from hvd_spark.runner.launcher import Launcher
from hvd_spark.runner.output import OutputForwarder
from hvd_spark.runner.rendezvous import RankInfo, TaskSlot, assign_ranks, with_master
from hvd_spark.runner.run_config import RunConfig, heartbeat_limit
from hvd_spark.runner.tied_child import WORKER_COMMAND, start_tied

# After a rank failed, how long the others may take to notice (its sockets closed) and
# report why, before the launcher stops them: each survivor's error then names the rank.
_NOTICE_S = 1.0
_HOST = "localhost"




def local_placement(num_proc: int, master_port: int | None = None) -> list[RankInfo]:
    """``num_proc`` ranks on this host, in rank order; with ``master_port`` (a port free
    here) rank 0's endpoint is every rank's torch.distributed master."""
    host = socket.gethostname()
    infos = assign_ranks([TaskSlot(rank, host) for rank in range(num_proc)])
    if master_port is not None:
        infos = with_master(infos, {0: ("127.0.0.1", master_port)})
    return [infos[rank] for rank in range(num_proc)]


def rank_env(rank: int, size: int, store_port: int, secret: bytes,
             heartbeat_s: float | None = None, master_port: int | None = None,
             run_id: str = "none") -> dict[str, str]:
    """The variables of one local rank: ours, and Horovod's and torch's names for them.

    ``heartbeat_s`` defaults to this process's limit (``heartbeat_limit({})``); with
    ``master_port`` (a port free on this host) the rank's torchrun world names its master.
    """
    info = local_placement(size, master_port)[rank]
    limit = heartbeat_limit({}) if heartbeat_s is None else heartbeat_s
    return {**torch_world.rank_world(info, run_id),
            **_env.launcher_variables(f"127.0.0.1:{store_port}", secret, limit, run_id)}


class LocalJob(Launcher):
    """One launch of N local ranks.

    Args:
        config: The number of ranks, their extra environment variables, the streams
            receiving their prefixed output lines, the heartbeat limit and stop grace.
        bind_host: Interface the rendezvous store listens on (hosts other than this
            one need an address they can reach, e.g. "0.0.0.0").
    """

    def __init__(self, config: RunConfig, bind_host: str = "127.0.0.1",
                 rank_envs: Sequence[Mapping[str, str]] | None = None) -> None:
        if config.num_proc is None:
            raise ConfigError("num_proc must be a positive integer, got None")
        self.num_proc = config.num_proc
        self.timeouts = config.timeouts
        self.secret = secrets.token_bytes(32)
        self.run_id = uuid.uuid4().hex[:12]
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.heartbeats = HeartbeatMonitor(self.timeouts.heartbeat_s, self._on_silent)
        self.store = StoreServer(self.secret, bind_host, {
            worker.REPORT: self._on_report, BEAT: self.heartbeats.beat})
        self._env = dict(config.env)
        self._rank_envs = [dict(e) for e in rank_envs or ()]
        self._output = OutputForwarder(config.stdout or sys.stdout, config.stderr or sys.stderr,
                                       timestamps=config.prefix_output_with_timestamp,
                                       tee=config.on_output)
        self.procs: list[subprocess.Popen] = []
        self.results: dict[int, bytes] = {}
        self.failures: list[WorkerFailure] = []
        self._expect_reports = False
        self._escalated = False  # SIGKILL sent to the ranks during a teardown

    def host_of(self, rank: int) -> str:
        """The host rank ``rank`` runs on, as failures name it."""
        return _HOST

    def _on_report(self, rank: int, status: str, payload: Any) -> None:
        self._events.put(("report", rank, status, payload, time.time()))

    def _on_silent(self, rank: int, seconds: float) -> None:
        self._events.put(("silent", rank, seconds, None, time.time()))

    def publish(self, payload: bytes) -> None:
        """Put the pickled function where the ranks' ``worker`` fetches it."""
        self.store.set(worker.FN_KEY, payload)

    def rank_env(self, info: RankInfo, store_host: str = "127.0.0.1") -> dict[str, str]:
        """What rank ``info.rank`` gets on top of its host's environment: the job's
        variables, its own, its place (``torch_world.rank_world``) and the way back here."""
        own = self._rank_envs[info.rank] if info.rank < len(self._rank_envs) else {}
        return {**self._env, **own, **torch_world.rank_world(info, self.run_id),
                **_env.launcher_variables(f"{store_host}:{self.store.port}", self.secret,
                                          self.timeouts.heartbeat_s, self.run_id)}

    def start(self, command: Sequence[str] | None = None) -> None:
        """Start one process per rank running ``command`` (default: the published function)."""
        self._expect_reports = command is None
        command = WORKER_COMMAND if command is None else command
        placement = local_placement(self.num_proc, torch_world.free_port("127.0.0.1"))
        for info in placement:
            # SIGTERM if the launcher dies: the rank may still flush its output.
            proc = start_tied(command, signal.SIGTERM, {**os.environ, **self.rank_env(info)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            self._follow(info.rank, proc)

    def _follow(self, rank: int, proc: subprocess.Popen) -> None:
        """Keep rank ``rank``'s process: forward its output, hear when it exits."""
        self.procs.append(proc)
        self._output.follow(rank, proc.stdout, proc.stderr)
        threading.Thread(target=self._watch, args=(rank, proc), daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        self._events.put(("exit", rank, code, None, time.time()))

    def watch(self) -> list[WorkerFailure]:
        """Wait for every rank to end; return the failures (empty on success)."""
        return self.wait(self._expect_reports)

    def wait(self, expect_reports: bool) -> list[WorkerFailure]:
        """Wait for every rank to end; return the failures (empty on success).

        Args:
            expect_reports: The ranks run the function, so each must report a result.
        """
        failures: dict[int, WorkerFailure] = {}
        exited: dict[int, int] = {}
        silent: set[int] = set()
        torn_down_at: float | None = None
        stop_at: float | None = None  # when to stop the ranks left, once one failed
        while len(exited) < self.num_proc:
            try:
                kind, rank, a, b, when = self._events.get(timeout=0.5)
            except queue.Empty:
                kind = ""
                if (torn_down_at is not None
                        and time.time() - torn_down_at > self.timeouts.stop_grace_s):
                    self._escalated = True
                    self._signal_all(signal.SIGKILL)
            if kind == "silent":
                failure = WorkerFailure(rank, self.host_of(rank), (
                    f"rank {rank} sent no heartbeat for {a:.0f} s: its process is frozen "
                    "(stopped, or stuck outside Python) or its host is unreachable"), lost=True)
                failures.setdefault(rank, failure)
                silent.add(rank)
                self.heartbeats.abort(failure.message)
                if stop_at is None:  # the others hear why, fail with it and report it
                    stop_at = time.time() + hearing_grace(self.timeouts.heartbeat_s)
            elif kind == "report":
                if a == "ok":
                    self.results[rank] = b
                else:
                    failures.setdefault(rank, b)
            elif kind == "exit":
                exited[rank] = a
                self.heartbeats.forget(rank)
                unreported = expect_reports and rank not in self.results
                if rank not in failures and (a != 0 or unreported):
                    # Ended before the teardown (a kill -9 that a peer reported first):
                    # its own fault, not the launcher's stop.
                    stopped = torn_down_at is not None and when >= torn_down_at
                    failures[rank] = WorkerFailure.from_exit(
                        rank, self.host_of(rank), a, torn_down=stopped,
                        escalated=self._escalated)
            if failures and torn_down_at is None:
                stop_at = time.time() + _NOTICE_S if stop_at is None else stop_at
                others_done = all(r in exited or r in silent for r in range(self.num_proc))
                if time.time() >= stop_at or others_done:
                    torn_down_at = time.time()
                    self._signal_all(signal.SIGTERM)
        self._drain_reports(failures)
        self._output.close()
        self.failures = list(failures.values())
        return self.failures

    def collect(self) -> list[bytes]:
        """The pickled results in rank order.

        Raises:
            WorkerFailedError: A rank failed.
        """
        if self.failures:
            raise WorkerFailedError(self.failures)
        return [self.results[r] for r in range(self.num_proc)]

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

    def stop(self) -> None:
        """SIGTERM every rank's process group, SIGKILL what is left after the grace."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.timeouts.stop_grace_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        self._signal_all(signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(5)

    def close(self) -> None:
        """Kill anything still running, remove what killed ranks left, stop the store."""
        self._signal_all(signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(5)
            if proc.stdin is not None:  # the ssh launcher keeps each rank's stdin open
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        remove_segments(job_tag(self.secret))
        self.heartbeats.close()
        self.store.close()

    def __enter__(self) -> LocalJob:
        return self


def run_local(
    fn: Callable,
    args: Sequence = (),
    kwargs: dict | None = None,
    num_proc: int | None = None,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    rank_envs: Sequence[Mapping[str, str]] | None = None,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` local ranks; results in rank order.

    Args:
        fn: The function each rank runs; it may call ``hvd_spark.collectives.init()``
            (or the torch/tensorflow bindings' ``init``).
        args: Positional arguments passed to ``fn`` (pickled with cloudpickle).
        kwargs: Keyword arguments passed to ``fn`` (pickled likewise).
        num_proc: Number of ranks (default: number of CPUs).
        env: Extra environment variables for the ranks.
        stdout: Stream receiving the ranks' stdout, each line prefixed ``[rank]``.
        stderr: Stream receiving the ranks' stderr, each line prefixed ``[rank]``.
        rank_envs: Variables for one rank each (index = rank), beside ``env``.

    Raises:
        WorkerFailedError: A rank failed; the others were stopped.
        ConfigError: Bad arguments, or something cannot be pickled.
    """
    num_proc = num_proc if num_proc is not None else (os.cpu_count() or 1)
    payload = worker.pickle_job(fn, args, kwargs)
    config = RunConfig.from_kwargs(where="run_local", num_proc=num_proc, env=env,
                                   stdout=stdout, stderr=stderr)
    with LocalJob(config, rank_envs=rank_envs) as job:
        return [cloudpickle.loads(result) for result in job.run(payload)]
