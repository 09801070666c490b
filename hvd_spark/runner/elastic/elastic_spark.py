"""``hvd_spark.run_elastic``: elastic training on Spark that survives lost executors.

Design. A barrier stage cannot lose a task without Spark cancelling all of them, so an
elastic run uses *ordinary* tasks, one per worker slot (``max_np`` of them), each hosting
one elastic worker process (:mod:`hvd_spark.runner.elastic.elastic_task`). The driver runs an
:class:`ElasticDriver` behind the run's authenticated store: the workers join *generations*
of the ring, beat a heartbeat, and report their results there.

- A lost executor kills its worker; the survivors' collectives fail at once (the ring's
  sockets reset) or, for a silent peer, when the driver stops hearing its heartbeat; they
  restore their last commit and re-form the ring without it.
- Spark runs the lost task again (``spark.task.maxFailures``) once an executor is free:
  the new attempt is a new worker, which joins the ring at the ranks' next ``commit()``.
  A task whose worker process failed (killed, or frozen and dropped) fails too where Spark
  retries tasks, else its slot would never come back (``ElasticTaskSpec.respawn``).
- Slots beyond the cluster's capacity simply wait in Spark's queue: they join when
  capacity appears, up to ``max_np`` ranks.
- The run ends when the final ring's ranks return; their results come back in rank order,
  and tasks still waiting are cancelled. A bug in ``fn`` (an error that is not a lost peer)
  ends the run at once with that rank's traceback, as ``hvd_spark.run`` does.
"""

from __future__ import annotations

import functools
import logging
import queue
import re
import secrets
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import IO, Any

from hvd_spark import _env
from hvd_spark.collectives.tcp.store import StoreServer
from hvd_spark.errors import ConfigError, ElasticJobError, WorkerFailedError
from hvd_spark.runner import worker
from hvd_spark.runner.elastic import elastic_task
from hvd_spark.runner.elastic.elastic_driver import ElasticDriver
from hvd_spark.runner.elastic.elastic_local import results_in_rank_order
from hvd_spark.runner.failures import WorkerFailure
from hvd_spark.runner.output import OutputForwarder
from hvd_spark.runner.run_config import ElasticConfig
from hvd_spark.runner.spark import spark_launcher
from hvd_spark.runner.spark.connect import is_connect
from hvd_spark.runner.spark.driver_service import LOG, STOP_KEY

log = logging.getLogger("hvd_spark.runner")

_POLL_S = 0.25
_FINISH_GRACE_S = 60.0
_LOST_PEER_ERRORS = ("HorovodInternalError", "PeerDisconnectedError", "ElasticJobError",
                     "RendezvousTimeoutError", "HostsUpdatedInterrupt")


def task_attempts(spark: Any) -> int:
    """How many times Spark runs a failing task (``spark.task.maxFailures``; local mode's
    default is 1, or F of ``local[N,F]``; a cluster's is 4)."""
    def conf(key: str) -> str:
        try:
            return str(spark.conf.get(key, "") or "")
        except Exception:  # noqa: BLE001 - a Connect server may refuse to show a setting
            return ""

    value = conf("spark.task.maxFailures")
    if value.isdigit():
        return int(value)
    master = conf("spark.master")
    match = re.fullmatch(r"local\[[^,\]]+,\s*(\d+)\]", master)
    if match:
        return int(match.group(1))
    return 1 if master.startswith("local") and not master.startswith("local-cluster") else 4


def is_lost_peer_failure(failure: WorkerFailure) -> bool:
    """True when a worker failed because the ring broke under it, not because of ``fn``."""
    return any(name in failure.message for name in _LOST_PEER_ERRORS)


class ElasticSparkRun:
    """One elastic run: its driver service, its Spark job and their supervision."""

    def __init__(self, spark: Any, settings: ElasticConfig, user_env: dict[str, str],
                 output: OutputForwarder, say: Callable[[str], None]) -> None:
        self.spark = spark
        self.settings = settings
        self.secret = secrets.token_bytes(32)
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self._output = output
        self._say = say
        self.driver = ElasticDriver(settings, on_event=say)
        sc = spark_launcher.cluster_context(spark)
        bind_host, advertise_host = spark_launcher.driver_hosts(sc)
        self.server = StoreServer(self.secret, bind_host, {
            **self.driver.handlers(),
            LOG: self._on_log,
            worker.REPORT: self._on_report,
            elastic_task.WORKER_EXIT: self._on_exit,
        })
        self.run_id = uuid.uuid4().hex[:12]
        self.job_group = f"hvd_spark-elastic-{self.run_id}"
        self.spec = elastic_task.ElasticTaskSpec(
            driver_addr=f"{advertise_host}:{self.server.port}", secret=self.secret,
            start_timeout=settings.start_timeout, elastic_timeout=settings.elastic_timeout,
            heartbeat_s=settings.heartbeat_s, env=user_env, run_id=self.run_id,
            respawn=task_attempts(spark) > 1)
        self.remote = is_connect(spark)
        self.results: dict[str, tuple[int, bytes]] = {}
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ service handlers

    def _on_log(self, partition: int, lines: list[tuple[str, str]]) -> None:
        for stream, line in lines:
            self._output.write(partition, stream, line)

    def _on_report(self, rank: int, status: str, payload: Any, worker_id: str = "?") -> None:
        self.events.put(("report", worker_id, (rank, status, payload)))

    def _on_exit(self, worker_id: str, returncode: int) -> None:
        self.events.put(("exit", worker_id, returncode))

    # ------------------------------------------------------------------ the Spark job

    def _collect(self) -> None:
        if self.remote:
            self.spark.addTag(self.job_group)
        else:
            self.spark.sparkContext.setJobGroup(
                self.job_group, f"hvd_spark.run_elastic of up to {self.settings.max_np} ranks",
                interruptOnCancel=True)
        error: BaseException | None = None
        try:
            n = self.settings.max_np
            frame = self.spark.range(n, numPartitions=n)
            frame.mapInArrow(functools.partial(elastic_task.arrow_task, self.spec),
                             elastic_task.OUTPUT_SCHEMA).collect()
        except BaseException as exc:  # noqa: BLE001 - handed to the supervising thread
            error = exc
        finally:
            if self.remote:
                self.spark.removeTag(self.job_group)
        self.events.put(("spark_done", "", error))

    def start(self, payload: bytes) -> None:
        """Publish the function and submit the job of worker tasks in the background."""
        from pyspark import InheritableThread

        self.server.set(worker.FN_KEY, payload)
        self._thread = InheritableThread(target=self._collect, name="hvd-elastic-job",
                                         daemon=True, session=self.spark)
        self._thread.start()

    def supervise(self) -> list:
        """Wait for the run's end; return the final ranks' results in rank order."""
        finished_at: float | None = None
        while True:
            try:
                kind, worker_id, value = self.events.get(timeout=_POLL_S)
            except queue.Empty:
                kind = ""
            if kind == "report":
                rank, status, payload = value
                if status == "ok":
                    self.results[worker_id] = (rank, payload)
                elif not is_lost_peer_failure(payload):
                    raise WorkerFailedError([payload])
            elif kind == "exit":
                self.driver.worker_exited(worker_id, value)
            elif kind == "spark_done" and not self.driver.finished:
                raise ElasticJobError(
                    f"the Spark job of the elastic run ended before training finished: "
                    f"{value or 'every task returned'}; lost so far: {self._lost()}")
            if self.driver.fatal:
                raise ElasticJobError(self.driver.fatal)
            if self.driver.finished:
                finished_at = finished_at or time.monotonic()
                done = all(w in self.results for w in self.driver.members)
                if done or time.monotonic() - finished_at > _FINISH_GRACE_S:
                    return results_in_rank_order(self.results, self.driver.members)

    def _lost(self) -> str:
        return "; ".join(f"worker {w} {why}" for w, why in self.driver.lost.items()) or "none"

    def close(self) -> None:
        """Stop the workers, cancel the job's waiting tasks, close the service."""
        self.driver.close()
        self.server.set(STOP_KEY, True)
        thread = self._thread
        if thread is not None and thread.is_alive():
            if self.remote:
                self.spark.interruptTag(self.job_group)
            else:
                self.spark.sparkContext.cancelJobGroup(self.job_group)
            thread.join(30.0)
        self._output.close()
        self.server.close()


def run_elastic(
    fn: Callable,
    args: Sequence = (),
    kwargs: dict | None = None,
    num_proc: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    start_timeout: float | None = None,
    elastic_timeout: float | None = None,
    reset_limit: int | None = None,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: int = 1,
    nics: Sequence[str] | str | None = None,
    prefix_output_with_timestamp: bool = False,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
) -> list:
    """Run ``fn`` elastically on Spark tasks: lost executors cost only the uncommitted work.

    ``fn`` uses ``hvd.elastic.run`` and a ``State`` (``TorchState``, ``KerasState``,
    ``ObjectState``) and commits regularly. Horovod's signature; see the module docstring
    for how it works on Spark.

    Args:
        fn: The training function.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        num_proc: Ranks of the first ring (default: the cluster's task slots).
        min_np: Fewest ranks to go on with (default ``num_proc``).
        max_np: Most ranks; also the number of Spark tasks (default ``num_proc``).
        start_timeout: Seconds for the workers' tasks to start (default 600); started
            workers then have ``elastic_timeout`` more to call ``init()`` (their imports
            do not count against it, as in Horovod).
        elastic_timeout: Seconds to re-form a ring after a loss (default 600).
        reset_limit: Most re-formations (default: no limit).
        env: Variables for every worker.
        stdout: Stream for the workers' stdout, prefixed with the task's partition.
        stderr: Stream for the workers' stderr, prefixed likewise.
        verbose: 0 quiet; 1 (default) membership changes on stderr.
        nics: The network interface for the ring (``HVD_SPARK_IFACE``).
        prefix_output_with_timestamp: Start each forwarded line with the time.
        min_num_proc: Horovod's older name for ``min_np``.
        max_num_proc: Horovod's older name for ``max_np``.

    Returns:
        The final ring's ranks' return values, index = rank.

    Raises:
        ConfigError: Bad sizes or arguments, no SparkSession, too few task slots.
        ElasticJobError: Too few workers left, ``reset_limit`` reached, or the Spark job
            ended; names what was lost and why.
        WorkerFailedError: ``fn`` itself failed on a rank (with its traceback).
    """
    payload = worker.pickle_job(fn, args, kwargs)
    spark = spark_launcher.active_session()
    sc = spark_launcher.cluster_context(spark)
    num_proc = spark_launcher.task_slots(sc) if num_proc is None else num_proc
    min_np = min_np if min_np is not None else min_num_proc  # Horovod's older names
    max_np = max_np if max_np is not None else max_num_proc
    settings = ElasticConfig.from_kwargs(num_proc, min_np, max_np, start_timeout,
                                         elastic_timeout, reset_limit, env)
    min_np = settings.min_np
    slots = spark_launcher.task_slots(sc)
    if slots < min_np:
        raise ConfigError(
            f"min_np={min_np} but the cluster runs only {slots} tasks at once; lower min_np "
            "or add executors")
    user_env = {str(k): str(v) for k, v in (env or {}).items()}
    if nics:
        user_env[_env.IFACE] = nics if isinstance(nics, str) else next(iter(nics))
    if settings.heartbeat_s and _env.HEARTBEAT not in user_env:
        user_env[_env.HEARTBEAT] = str(settings.heartbeat_s)
    err = stderr or sys.stderr

    def say(line: str) -> None:
        if verbose >= 1:
            err.write(f"hvd_spark.run_elastic: {line}\n")
            err.flush()
        log.info("run_elastic: %s", line)

    output = OutputForwarder(stdout or sys.stdout, err, timestamps=prefix_output_with_timestamp)
    run = ElasticSparkRun(spark, settings, user_env, output, say)
    try:
        run.start(payload)
        return run.supervise()
    finally:
        run.close()
