"""What each Spark barrier task does: register, start its rank, relay, clean up.

Runs inside Spark's Python worker. The task registers with the driver's service,
learns its rank, starts ``python -m hvd_spark.runner.worker`` as a child in its own
process group, sends the child's output lines to the driver, and reports how the
child ended. The child dies with the task (PR_SET_PDEATHSIG), when the driver says
stop, and its whole process group is killed when the task returns (see
``hvd_spark.runner.spark.task_process``, shared with the elastic tasks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

from hvd_spark import _env
from hvd_spark.collectives.tcp import wire
from hvd_spark.collectives.tcp.store import StoreClient
from hvd_spark.config import advertise_addr
from hvd_spark.errors import ConfigError, HvdSparkError, RendezvousTimeoutError
from hvd_spark.runner import torch_world
from hvd_spark.runner.failures import WorkerFailure
from hvd_spark.runner.rendezvous import RankInfo
from hvd_spark.runner.spark.driver_service import EXIT, REGISTER, SHARE_ROWS, TASK_ERROR
from hvd_spark.runner.spark.task_process import (
    DRAIN_S,
    LogSender,
    reap_worker,
    send_rank_env,
    start_worker,
    task_gpu_addresses,
    watch_stop,
)

#: Seconds a task may take to reach the driver's service (already listening) at start.
CONNECT_TIMEOUT_S = 30.0
OUTPUT_SCHEMA = "partition long, returncode long"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskLink:
    """What every task of a run needs to reach the driver and start its process
    (``hvd_spark.run``'s barrier tasks and ``run_elastic``'s tasks alike).

    Attributes:
        driver_addr: ``host:port`` of the driver's service.
        secret: The run's secret.
        start_timeout_s: Seconds to connect and for the ranks to start.
        heartbeat_s: Seconds of silence after which a rank counts as lost.
        env: User variables added to each rank's environment.
        run_id: Identifies the run in logs.
    """

    driver_addr: str
    secret: bytes
    start_timeout_s: float
    heartbeat_s: float
    env: dict[str, str]
    run_id: str

    def process_env(self, base: dict[str, str]) -> dict[str, str]:
        """The executor's (``base``) + user's + the run's variables, which a rank's process
        starts with: how it reaches the driver (``_env.launcher_variables``)."""
        env = {**base, **self.env}
        env.setdefault(_env.START_TIMEOUT, str(self.start_timeout_s))
        env.update(_env.launcher_variables(self.driver_addr, self.secret, self.heartbeat_s,
                                           self.run_id))
        return env


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskSpec(TaskLink):
    """Everything a barrier task needs, shipped to the executors in the job's closure.

    Attributes:
        use_gpu: Show the child its host's GPUs of this job as CUDA_VISIBLE_DEVICES, its own
            at index ``local_rank`` (``gpu_mapping``).
        ranks_per_task: Ranks each task runs (one per GPU of the task, each registering
            as its own slot ``partition * ranks_per_task + i``).
        with_share: The barrier stage runs over the job's DataFrame (``run(fn, df=...)``):
            each task writes its partition's rows to local disk for its rank.
    """

    use_gpu: bool = False
    ranks_per_task: int = 1
    with_share: bool = False


def early_env(base: dict[str, str], spec: TaskSpec) -> dict[str, str]:
    """The part of a rank's environment known before the task registers: executor's +
    user's + the run's variables (the worker starts with it; see :func:`child_env`)."""
    env = spec.process_env(base)
    env.pop(_env.GPU_INDEX, None)  # only this rank's own index may reach it
    return env


def child_env(
    base: dict[str, str], spec: TaskSpec, info: RankInfo, gpus: list[str] | None,
    task_gpus: list[str] | None = None,
) -> dict[str, str]:
    """The environment of a rank's process: executor's + user's + the rank's variables
    (ours, and Horovod's and torch's names for them).

    ``gpus`` (when not None) becomes ``CUDA_VISIBLE_DEVICES``, with ``info.gpu_index`` as
    ``HVD_SPARK_GPU_INDEX`` and CUDA numbering devices as ``nvidia-smi`` (and so Spark's
    discovery scripts) do, unless the executor says otherwise; ``task_gpus`` (when not
    None) are the task's Spark GPU addresses, for ``hvd_spark.task.get_available_devices``.
    """
    env = early_env(base, spec)
    env.update(torch_world.rank_world(info, spec.run_id))
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        # CUDA's default order is fastest first; Spark's addresses are nvidia-smi's indices.
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        if gpus and info.gpu_index is not None:
            env[_env.GPU_INDEX] = str(info.gpu_index)
    if task_gpus is not None:
        # Set even when empty: "Spark gave no GPUs" must not fall back to CUDA_VISIBLE_DEVICES.
        env[_env.TASK_GPUS] = ",".join(task_gpus)
    return env


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


def rank_gpus(spec: TaskSpec, info: RankInfo) -> list[str] | None:
    """The rank's ``CUDA_VISIBLE_DEVICES`` entries: its host's GPUs of this job with
    ``use_gpu`` (none when its own task has none), None (the executor's) without."""
    if not spec.use_gpu:
        return None
    return list(info.host_gpus) if info.gpu_index is not None else []


def task_host() -> str:
    """The name the task registers its host by: ``HVD_SPARK_HOSTNAME`` when the executor's
    environment sets it (as the ranks read it), else the machine's host name."""
    return _env.get_str(_env.HOSTNAME) or socket.gethostname()


def run_task(spec: TaskSpec, partition: int, task_gpus: list[str],
             rows: Iterator[Any] | None = None) -> int:
    """Run one rank of the job for ``partition``; return its process's exit code.

    ``task_gpus``: the GPU addresses Spark gave this task, sent to the driver at
    registration (which answers with the host's GPU order) and passed to the rank.
    ``rows``: the task's Arrow batches of the job's DataFrame (``run(fn, df=...)``), written
    to this executor's local disk for the rank (while the rank starts: see ``ShareWrite``)
    and removed when the rank has ended.
    """
    host = task_host()
    # The rank's interpreter starts and imports while the task registers (the rank's
    # variables follow on its stdin): the longest steps of a start.
    started_with = early_env(dict(os.environ), spec)
    proc = start_worker(started_with, rank_env_later=True)
    share: ShareWrite | None = None
    try:
        if rows is not None:
            share = ShareWrite(rows, spec.run_id, partition)
        client = connect_to_driver(spec.driver_addr, spec.secret, spec.start_timeout_s, host)
        try:
            return _serve_rank(client, proc, started_with, spec, partition, host, task_gpus,
                               share)
        finally:
            client.close()
    finally:
        reap_worker(proc, spec.secret)
        if share is not None:
            share.remove()


class ShareWrite:
    """A task's share of the DataFrame, written to local disk by a thread of its own.

    The rank starts (imports its framework, joins the ring, builds its model) while its
    rows arrive: it reads them only once every task has written its share and told the
    driver how many rows it has (``_env.SHARE_MIN_ROWS_KEY``).

    Args:
        rows: The task's Arrow record batches (read by the thread alone from now on).
        run_id: The run's id, part of the file's name.
        partition: The task's partition.
    """

    def __init__(self, rows: Iterator[Any], run_id: str, partition: int) -> None:
        # Only here: the data layer's import (pyarrow.dataset, pandas) costs a task
        # ~0.3 s, which a run without a DataFrame must not pay.
        from hvd_spark.data.rank_share import share_directory

        self.path = os.path.join(share_directory(), f"hvd_spark-{run_id}-{partition}.arrow")
        self._rows: int | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write, args=(rows,), daemon=True,
                                        name=f"hvd-share-{partition}")
        self._thread.start()

    def _write(self, rows: Iterator[Any]) -> None:
        from hvd_spark.data.rank_share import write_share

        try:
            self._rows = write_share(rows, self.path)
        except BaseException as exc:  # noqa: BLE001 - raised in the task by wait()
            self._error = exc

    def wait(self) -> int:
        """Wait until the share is on disk; its rows.

        Raises:
            BaseException: What writing it raised (a full disk, a failed upstream task).
        """
        # No deadline of its own: the thread ends with the task's input, which Spark
        # bounds (a lost upstream task fails the stage, and with it this read).
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._rows is not None
        return self._rows

    def remove(self) -> None:
        """Delete the file, once the thread is done with it (the task ends only after)."""
        self._thread.join()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)


def run_task_ranks(spec: TaskSpec, partition: int, task_gpus: list[str]) -> int:
    """Run the task's ``spec.ranks_per_task`` ranks, each with one of the task's GPUs; the
    first non-zero exit code among them (0 when all succeeded).

    Raises:
        ConfigError: Spark gave the task a number of GPUs other than its ranks.
    """
    per_task = spec.ranks_per_task
    if per_task == 1:
        return run_task(spec, partition, task_gpus)
    if task_gpus and len(task_gpus) != per_task:
        raise ConfigError(f"this task runs {per_task} ranks but Spark gave it GPUs "
                          f"{task_gpus}: one GPU per rank is needed")
    codes = [0] * per_task

    def serve(i: int) -> None:
        own = [task_gpus[i]] if task_gpus else []
        codes[i] = run_task(spec, partition * per_task + i, own)

    threads = [threading.Thread(target=serve, args=(i,), name=f"hvd-slot-{i}", daemon=True)
               for i in range(per_task)]
    for thread in threads:
        thread.start()
    for thread in threads:
        # run_task ends with its rank, which the driver stops within its own deadlines.
        while thread.is_alive():
            thread.join(1.0)
    return next((code for code in codes if code), 0)


def _serve_rank(client: StoreClient, proc: subprocess.Popen, started_with: dict[str, str],
                spec: TaskSpec, partition: int, host: str, task_gpus: list[str],
                share: ShareWrite | None) -> int:
    """Register, hand the worker its rank, relay its output until it ends; its exit code."""
    try:
        # This host's address as the other ranks reach it, and a port free here: the
        # torch.distributed master's, should this task become rank 0.
        endpoint = (advertise_addr() or client.local_address, torch_world.free_port())
        info: RankInfo = client.call(REGISTER, partition, host, spec.start_timeout_s,
                                     tuple(task_gpus), endpoint,
                                     timeout=spec.start_timeout_s)
        env = child_env(dict(os.environ), spec, info, rank_gpus(spec, info), task_gpus)
        if share is not None:
            # No SHARE_MIN_ROWS: the rank asks the driver, once every share is written.
            env[_env.SHARE_PATH] = share.path
        send_rank_env(proc, started_with, env)
    except Exception as exc:  # noqa: BLE001 - reported to the driver, then re-raised
        _report_task_error(client, partition, host, exc)
        raise
    sender = LogSender(client, info.rank)
    sender.follow(proc.stdout, proc.stderr)
    stopped = threading.Event()
    threading.Thread(target=watch_stop, args=(
        spec.driver_addr, spec.secret, spec.start_timeout_s, proc, stopped),
        daemon=True).start()
    if share is not None:
        try:
            client.call(SHARE_ROWS, partition, share.wait(), timeout=wire.HANDSHAKE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - reported to the driver, then re-raised
            _report_task_error(client, partition, host, exc)
            raise
    returncode = proc.wait()  # bounded by the driver's stop and the ranks' timeouts
    sender.close(DRAIN_S)
    with contextlib.suppress(HvdSparkError, OSError):
        client.call(EXIT, info.rank, returncode, stopped.is_set(),
                    timeout=wire.HANDSHAKE_TIMEOUT_S)
    return returncode


def _report_task_error(client: StoreClient, partition: int, host: str,
                       exc: BaseException) -> None:
    """Tell the driver why this task cannot serve its rank (it then stops the run)."""
    with contextlib.suppress(Exception):
        client.call(TASK_ERROR, partition, WorkerFailure.from_exception(partition, host, exc),
                    timeout=wire.HANDSHAKE_TIMEOUT_S)


def arrow_task(spec: TaskSpec, batches: Iterator[Any]) -> Iterator[Any]:
    """``mapInArrow(..., barrier=True)`` body: one row (partition, returncode) per task."""
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    partition = context.partitionId()
    if spec.with_share:
        returncode = run_task(spec, partition, task_gpu_addresses(context), rows=batches)
    else:
        for _ in batches:
            pass
        returncode = run_task_ranks(spec, partition, task_gpu_addresses(context))
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
    yield partition, run_task_ranks(spec, partition, task_gpu_addresses(context))
