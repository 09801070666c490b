"""What each Spark barrier task does: register, start its rank, relay, clean up.

Runs inside Spark's Python worker. The task registers with the driver's service,
learns its rank, starts ``python -m hvd_spark.runner.worker`` as a child in its own
process group, sends the child's output lines to the driver, and reports how the
child ended. The child dies with the task (PR_SET_PDEATHSIG), when the driver says
stop, and its whole process group is killed when the task returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

from hvd_spark import _env
from hvd_spark.collectives.tcp import wire
from hvd_spark.collectives.tcp.shm import job_tag, remove_segments
from hvd_spark.collectives.tcp.store import StoreClient
from hvd_spark.errors import HvdSparkError, RendezvousTimeoutError
from hvd_spark.runner.driver_service import EXIT, LOG, REGISTER, STOP_KEY, TASK_ERROR
from hvd_spark.runner.failures import WorkerFailure
from hvd_spark.runner.rendezvous import RankInfo

_KILL_GRACE_S = 2.0
#: Seconds a task may take to reach the driver's service (already listening) at start.
CONNECT_TIMEOUT_S = 30.0
_DRAIN_S = 5.0
_STOP_POLL_S = 1.0
_SELF_EXIT_GRACE_S = 0.5
OUTPUT_SCHEMA = "partition long, returncode long"


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """Everything a task needs, shipped to the executors in the job's closure.

    Attributes:
        driver_addr: ``host:port`` of the driver's service.
        secret: The run's secret.
        start_timeout: Seconds to wait for all tasks to register and the ranks to connect.
        env: User variables added to each rank's environment.
        use_gpu: Give the child the task's GPUs as CUDA_VISIBLE_DEVICES.
        run_id: Identifies the run in logs.
    """

    driver_addr: str
    secret: bytes
    start_timeout: float
    env: dict[str, str]
    use_gpu: bool
    run_id: str


def child_env(
    base: dict[str, str], spec: TaskSpec, info: RankInfo, gpus: list[str] | None
) -> dict[str, str]:
    """The environment of a rank's process: executor's + user's + the rank's variables
    (ours, and Horovod's and torch's names for them)."""
    env = {**base, **spec.env}
    env.setdefault(_env.START_TIMEOUT, str(spec.start_timeout))
    env.update(_env.rank_variables(info.rank, info.size, info.local_rank, info.local_size,
                                   info.cross_rank, info.cross_size, info.host))
    env.update({
        _env.RENDEZVOUS_ADDR: spec.driver_addr,
        _env.SECRET: spec.secret.hex(),
        _env.RUN_ID: spec.run_id,
        "PYTHONUNBUFFERED": "1",
    })
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


def _die_with_task() -> None:
    # Linux: the kernel SIGKILLs the rank if the task's thread dies (e.g. Spark kills it).
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class _LogSender:
    """Reads a child's two pipes and sends their lines to the driver in batches."""

    def __init__(self, client: StoreClient, rank: int) -> None:
        self._client = client
        self._rank = rank
        self._lines: queue.SimpleQueue = queue.SimpleQueue()
        self._pumps: list[threading.Thread] = []
        self._sender = threading.Thread(target=self._send_loop, name="hvd-log", daemon=True)

    def follow(self, out_pipe: IO[bytes], err_pipe: IO[bytes]) -> None:
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
                    self._client.call(LOG, self._rank, lines, timeout=wire.HANDSHAKE_TIMEOUT_S)
                except (HvdSparkError, OSError):
                    return  # the driver is gone; the stop watcher kills the child

    def close(self, timeout: float) -> None:
        """Wait (bounded) until the pipes are drained and every line is sent."""
        for pump in self._pumps:
            pump.join(timeout)
        self._lines.put(None)
        self._sender.join(timeout)


def _watch_stop(spec: TaskSpec, proc: subprocess.Popen, stopped: threading.Event) -> None:
    """Kill the child when the driver says stop or becomes unreachable."""
    try:
        client = StoreClient(wire.parse_addr(spec.driver_addr), spec.secret, spec.start_timeout)
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
    _kill_group(proc, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(_KILL_GRACE_S)
    _kill_group(proc, signal.SIGKILL)


def connect_to_driver(driver_addr: str, secret: bytes, start_timeout: float,
                      host: str) -> StoreClient:
    """Connect to the driver's service, or fail soon with what stands in the way.

    The service listens before any task starts, so a task that cannot reach it within
    ``CONNECT_TIMEOUT_S`` is cut off from the driver (a firewall, a partition): say so
    now, instead of letting the driver wait for the whole start timeout.
    """
    timeout = min(start_timeout, CONNECT_TIMEOUT_S)
    try:
        return StoreClient(wire.parse_addr(driver_addr), secret, timeout)
    except (HvdSparkError, OSError) as exc:
        raise RendezvousTimeoutError(
            f"the Spark task on host {host} cannot reach the hvd_spark driver service at "
            f"{driver_addr} within {timeout:.0f} s ({exc}): a firewall or a network "
            "partition separates this executor from the driver; let the executors reach "
            "the driver's ports, or set spark.driver.host to an address they can reach"
        ) from exc


def run_task(spec: TaskSpec, partition: int, gpus: list[str] | None) -> int:
    """Run one rank of the job for ``partition``; return its process's exit code."""
    host = socket.gethostname()
    client = connect_to_driver(spec.driver_addr, spec.secret, spec.start_timeout, host)
    try:
        try:
            info: RankInfo = client.call(
                REGISTER, partition, host, spec.start_timeout, timeout=spec.start_timeout)
            proc = subprocess.Popen(
                [sys.executable, "-m", "hvd_spark.runner.worker"],
                env=child_env(dict(os.environ), spec, info, gpus),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, preexec_fn=_die_with_task,
            )
        except Exception as exc:  # noqa: BLE001 - reported to the driver, then re-raised
            with contextlib.suppress(Exception):
                client.call(TASK_ERROR, partition, WorkerFailure.from_exception(
                    partition, host, exc), timeout=wire.HANDSHAKE_TIMEOUT_S)
            raise
        try:
            sender = _LogSender(client, info.rank)
            sender.follow(proc.stdout, proc.stderr)
            stopped = threading.Event()
            threading.Thread(target=_watch_stop, args=(spec, proc, stopped), daemon=True).start()
            returncode = proc.wait()  # bounded by the driver's stop and the ranks' timeouts
            sender.close(_DRAIN_S)
            with contextlib.suppress(HvdSparkError, OSError):
                client.call(EXIT, info.rank, returncode, stopped.is_set(),
                            timeout=wire.HANDSHAKE_TIMEOUT_S)
            return returncode
        finally:
            # Also reaches processes the rank started and left behind.
            _kill_group(proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(_KILL_GRACE_S)
            if _failed(proc):
                remove_segments(job_tag(spec.secret))
    finally:
        client.close()


def _failed(proc: subprocess.Popen) -> bool:
    """True when the rank did not exit cleanly (it may have left a shm segment behind)."""
    return proc.returncode is None or proc.returncode != 0


def _task_gpus(context: Any, use_gpu: bool) -> list[str] | None:
    if not use_gpu:
        return None
    resource = context.resources().get("gpu")
    return list(resource.addresses) if resource is not None else []


def arrow_task(spec: TaskSpec, batches: Iterator[Any]) -> Iterator[Any]:
    """``mapInArrow(..., barrier=True)`` body: one row (partition, returncode) per task."""
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    for _ in batches:
        pass
    context = BarrierTaskContext.get()
    partition = context.partitionId()
    returncode = run_task(spec, partition, _task_gpus(context, spec.use_gpu))
    yield pa.RecordBatch.from_pydict(
        {"partition": [partition], "returncode": [returncode]},
        schema=pa.schema([("partition", pa.int64()), ("returncode", pa.int64())]),
    )


def rdd_task(spec: TaskSpec, rows: Iterator[Any]) -> Iterator[tuple[int, int]]:
    """``rdd.barrier().mapPartitions`` body, for Spark versions without the DataFrame API."""
    from pyspark import BarrierTaskContext

    for _ in rows:
        pass
    context = BarrierTaskContext.get()
    partition = context.partitionId()
    yield partition, run_task(spec, partition, _task_gpus(context, spec.use_gpu))
