"""A Spark task's worker process: start it, relay its output, stop it, reap it.

Shared by the barrier tasks of ``hvd_spark.run`` (``spark_task``) and the ordinary
tasks of ``run_elastic`` (``elastic_task``). Both start ``python -m
hvd_spark.runner.worker`` as a child in its own process group that dies with the task,
send its output lines to the driver, kill it when the driver says stop, and kill its
whole group when the task returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from typing import IO, Any

from hvd_spark import _env
from hvd_spark.collectives.tcp import wire
from hvd_spark.collectives.tcp.shm import job_tag, remove_segments
from hvd_spark.collectives.tcp.store import StoreClient
from hvd_spark.errors import HvdSparkError, RendezvousTimeoutError
from hvd_spark.runner.run_config import DEFAULT_STOP_GRACE_S
from hvd_spark.runner.spark.driver_service import LOG, STOP_KEY
from hvd_spark.runner.tied_child import WORKER_COMMAND, start_tied

#: Seconds to wait for a finished worker's last output lines to reach the driver.
DRAIN_S = 5.0
_STOP_POLL_S = 1.0
_SELF_EXIT_GRACE_S = 0.5


def kill_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the worker's process group (ignored when it is already gone).

    Args:
        proc: A worker started with ``start_new_session=True``.
        sig: The signal to send.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def task_gpu_addresses(context: Any) -> list[str]:
    """The GPU addresses Spark assigned to this task (``[]`` without GPU scheduling).

    Args:
        context: The task's ``TaskContext`` (or ``BarrierTaskContext``).

    Returns:
        ``context.resources()["gpu"].addresses`` as strings, e.g. ``["0"]``.
    """
    resource = context.resources().get("gpu")
    return [str(a) for a in resource.addresses] if resource is not None else []


def start_worker(env: dict[str, str], rank_env_later: bool = False) -> subprocess.Popen:
    """Start ``python -m hvd_spark.runner.worker`` in its own process group.

    Args:
        env: The worker's whole environment (with ``rank_env_later``: all but its rank's
            variables).
        rank_env_later: The worker waits for its rank's variables on stdin
            (:func:`send_rank_env`; ``worker.receive_rank_env`` reads them), so that
            its interpreter starts and imports while the task registers with the driver.

    Returns:
        The process, its stdout and stderr piped (see :class:`LogSender`).
    """
    if rank_env_later:
        env = {**env, _env.RANK_ENV_ON_STDIN: "1"}
    # SIGKILL when the task's thread dies: Spark may kill it without running any of our
    # clean-up, and the worker must not outlive it.
    return start_tied(WORKER_COMMAND, signal.SIGKILL, env,
                      stdin=subprocess.PIPE if rank_env_later else subprocess.DEVNULL,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def send_rank_env(proc: subprocess.Popen, started_with: dict[str, str],
                  env: dict[str, str]) -> None:
    """Hand a worker started with ``rank_env_later`` the rest of its environment.

    Args:
        proc: The worker.
        started_with: The environment it was started with.
        env: The environment it must run with: what differs is sent, what is missing is
            removed.
    """
    message = {"set": {k: v for k, v in env.items() if started_with.get(k) != v},
               "unset": sorted(set(started_with) - set(env))}
    # A worker that already died closed its end: its exit code and stderr say why.
    with contextlib.suppress(BrokenPipeError, OSError):
        proc.stdin.write(json.dumps(message).encode() + b"\n")
        proc.stdin.close()


def reap_worker(proc: subprocess.Popen, secret: bytes) -> None:
    """Kill the worker's group and reap it; remove its shm segments if it failed.

    Killing the group also reaches processes the worker started and left behind. A
    worker that did not exit cleanly may have left a shared-memory segment of the job.

    Args:
        proc: The worker, ended or not.
        secret: The job's secret, which names its shm segments.
    """
    kill_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(DEFAULT_STOP_GRACE_S)
    if proc.returncode != 0:  # None (still not reaped) counts as failed
        remove_segments(job_tag(secret))


class LogSender:
    """Reads a worker's two pipes and sends their lines to the driver in batches.

    Args:
        client: A connection to the driver's service.
        source: What the driver labels the lines with (a rank, or an elastic task's
            partition).
    """

    def __init__(self, client: StoreClient, source: int) -> None:
        self._client = client
        self._source = source
        self._lines: queue.SimpleQueue = queue.SimpleQueue()
        self._pumps: list[threading.Thread] = []
        self._sender = threading.Thread(target=self._send_loop, name="hvd-log", daemon=True)

    def follow(self, out_pipe: IO[bytes], err_pipe: IO[bytes]) -> None:
        """Start reading ``out_pipe`` and ``err_pipe`` and sending their lines."""
        for name, pipe in (("stdout", out_pipe), ("stderr", err_pipe)):
            pump = threading.Thread(target=self._pump, args=(name, pipe), daemon=True)
            pump.start()
            self._pumps.append(pump)
        self._sender.start()

    def _pump(self, name: str, pipe: IO[bytes]) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                self._lines.put((name, raw.decode("utf-8", errors="replace")))

    def _send_loop(self) -> None:
        done = False
        while not done:
            batch = [self._lines.get()]
            while True:  # whatever else is already there goes in the same message
                try:
                    batch.append(self._lines.get_nowait())
                except queue.Empty:
                    break
            done = batch[-1] is None
            lines = [item for item in batch if item is not None]
            if lines:
                try:
                    self._client.call(LOG, self._source, lines,
                                      timeout=wire.HANDSHAKE_TIMEOUT_S)
                except (HvdSparkError, OSError):
                    return  # the driver is gone; the stop watcher kills the child

    def close(self, timeout: float) -> None:
        """Wait (bounded) until the pipes are drained and every line is sent.

        Args:
            timeout: Seconds to wait for each pipe and for the sender, separately.
        """
        for pump in self._pumps:
            pump.join(timeout)
        self._lines.put(None)
        self._sender.join(timeout)


def watch_stop(driver_addr: str, secret: bytes, connect_timeout: float,
               proc: subprocess.Popen, stopped: threading.Event) -> None:
    """Kill the worker when the driver says stop or becomes unreachable.

    Meant as a daemon thread's target; returns once the worker has ended.

    Args:
        driver_addr: ``host:port`` of the driver's service.
        secret: The run's secret.
        connect_timeout: Seconds to connect to the driver's service.
        proc: The worker.
        stopped: Set when this watcher (not the worker itself) ended the worker.
    """
    try:
        client = StoreClient(wire.parse_addr(driver_addr), secret, connect_timeout)
    except (HvdSparkError, OSError):
        stopped.set()
        _terminate(proc)
        return
    try:
        while _running(proc):
            try:
                client.get(STOP_KEY, _STOP_POLL_S)
            except RendezvousTimeoutError:
                continue
            except (HvdSparkError, OSError):
                pass  # the driver is gone: nobody will collect the result
            # A rank that already failed may still be dying (its sockets close before it
            # is reaped): give it a moment, so it is not reported as stopped by us.
            deadline = time.monotonic() + _SELF_EXIT_GRACE_S
            while _running(proc) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _running(proc):
                stopped.set()
                _terminate(proc)
            return
    finally:
        client.close()


def _running(proc: subprocess.Popen) -> bool:
    # Not proc.poll(): it answers None while another thread waits on the process.
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False  # already reaped


def _terminate(proc: subprocess.Popen) -> None:
    kill_group(proc, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(DEFAULT_STOP_GRACE_S)
    kill_group(proc, signal.SIGKILL)
