"""What each Spark task of ``run_elastic`` does: host one elastic worker.

Unlike ``hvd_spark.run``'s barrier tasks, these are ordinary tasks: Spark may lose one
with its executor and run it again elsewhere, and the others go on. Each task attempt
is a new worker (id ``<partition>.<attempt>``) that joins the ring at its next
re-formation. The task starts ``python -m hvd_spark.runner.worker`` with the elastic
environment, relays its output to the driver (as the barrier tasks do, with
``hvd_spark.runner.spark.task_process``), tells the driver how it ended, and never
fails itself for a worker that failed: the driver decides what a failure means.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

from hvd_spark import _env
from hvd_spark.collectives.tcp import wire
from hvd_spark.errors import HvdSparkError
from hvd_spark.runner.elastic.elastic_driver import DESCRIBE, STARTED
from hvd_spark.runner.gpu_mapping import index_in_visible
from hvd_spark.runner.spark.spark_task import TaskLink, connect_to_driver, task_host
from hvd_spark.runner.spark.task_process import (
    DRAIN_S,
    LogSender,
    reap_worker,
    start_worker,
    task_gpu_addresses,
    watch_stop,
)

WORKER_EXIT = "elastic.exit"
OUTPUT_SCHEMA = "partition long, returncode long"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElasticTaskSpec(TaskLink):
    """What every task of an elastic run receives.

    Attributes:
        elastic_timeout_s: Seconds to re-form a ring (``HVD_SPARK_ELASTIC_TIMEOUT``).
        respawn: Fail the task when its worker process fails, so that Spark runs it again
            as a new worker (when Spark may retry a task: ``spark.task.maxFailures`` > 1).
    """

    elastic_timeout_s: float
    respawn: bool = False


class WorkerProcessFailed(HvdSparkError):
    """An elastic worker's process failed; its task fails so that Spark retries it."""


def worker_env(base: dict[str, str], spec: ElasticTaskSpec, worker: str,
               host: str, task_gpus: list[str] | None = None) -> dict[str, str]:
    """The environment of an elastic worker process: no rank, a worker id to join with.

    ``task_gpus`` (when not None) are the task's Spark GPU addresses, for
    ``hvd_spark.task.get_available_devices``. The worker keeps the executor's
    ``CUDA_VISIBLE_DEVICES``: its local rank changes as the ring re-forms, so no host
    order could put its GPU at ``local_rank`` for good; ``HVD_SPARK_GPU_INDEX`` says where
    its first GPU is (``gpu_mapping.index_in_visible``).
    """
    env = spec.process_env(base)
    for var in (_env.RANK, _env.SIZE, _env.LOCAL_RANK, _env.LOCAL_SIZE, _env.CROSS_RANK,
                _env.CROSS_SIZE, _env.GPU_INDEX):
        env.pop(var, None)
    if task_gpus is not None:
        env[_env.TASK_GPUS] = ",".join(task_gpus)
        index = (index_in_visible(task_gpus[0], env.get("CUDA_VISIBLE_DEVICES"))
                 if task_gpus else None)
        if index is not None:
            env[_env.GPU_INDEX] = str(index)
    env.update({
        _env.ELASTIC: "1",
        _env.WORKER_ID: worker,
        _env.HOSTNAME: host,
        _env.ELASTIC_TIMEOUT: str(spec.elastic_timeout_s),
    })
    return env


def executor_label() -> str:
    """"Spark executor N (pid P)" for the executor JVM above this process, or ""."""
    pid = os.getpid()
    with contextlib.suppress(OSError, ValueError, IndexError):
        for _ in range(8):  # task thread -> python worker (-> daemon) -> executor JVM
            with open(f"/proc/{pid}/stat") as stat:
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as cmd:
                args = cmd.read().split(b"\0")
            if b"--executor-id" in args:
                executor = args[args.index(b"--executor-id") + 1].decode()
                return f"Spark executor {executor} (pid {pid})"
    return ""


def run_worker(spec: ElasticTaskSpec, partition: int, attempt: int,
               task_gpus: list[str] | None = None) -> int:
    """Host worker ``<partition>.<attempt>`` until it ends; return its exit code.

    ``task_gpus``: the GPU addresses Spark gave the task (see :func:`worker_env`).
    """
    host = task_host()
    worker = f"{partition}.{attempt}"
    client = connect_to_driver(spec.driver_addr, spec.secret, spec.start_timeout_s, host)
    proc: subprocess.Popen | None = None
    try:
        label = executor_label()
        if label:
            client.call(DESCRIBE, worker, label, timeout=wire.HANDSHAKE_TIMEOUT_S)
        # Started: from here the driver waits for this worker's init() past the start
        # timeout (the process's imports do not count against it).
        client.call(STARTED, worker, host, timeout=wire.HANDSHAKE_TIMEOUT_S)
        proc = start_worker(worker_env(dict(os.environ), spec, worker, host, task_gpus))
        # Output lines carry the partition: the worker's rank changes as the ring re-forms.
        sender = LogSender(client, partition)
        sender.follow(proc.stdout, proc.stderr)
        stopped = threading.Event()
        threading.Thread(target=watch_stop, args=(
            spec.driver_addr, spec.secret, spec.start_timeout_s, proc, stopped),
            daemon=True).start()
        returncode = proc.wait()
        sender.close(DRAIN_S)
        with contextlib.suppress(HvdSparkError, OSError):
            client.call(WORKER_EXIT, worker, returncode, timeout=wire.HANDSHAKE_TIMEOUT_S)
        return returncode
    finally:
        if proc is not None:
            reap_worker(proc, spec.secret)
        client.close()


def arrow_task(spec: ElasticTaskSpec, batches: Iterator[Any]) -> Iterator[Any]:
    """``mapInArrow`` body (no barrier): one row (partition, returncode) per task."""
    import pyarrow as pa
    from pyspark import TaskContext

    for _ in batches:
        pass
    context = TaskContext.get()
    partition = context.partitionId()
    returncode = run_worker(spec, partition, context.attemptNumber(),
                            task_gpu_addresses(context))
    if returncode != 0 and spec.respawn:
        # A task that ends normally is never run again: its slot would be gone for good
        # after a rank was killed or froze, as if its executor had never come back.
        raise WorkerProcessFailed(
            f"hvd_spark.run_elastic: worker {partition}.{context.attemptNumber()} exited with "
            f"code {returncode}; failing its task so that Spark runs it again as a new worker")
    yield pa.RecordBatch.from_pydict(
        {"partition": [partition], "returncode": [returncode]},
        schema=pa.schema([("partition", pa.int64()), ("returncode", pa.int64())]),
    )
