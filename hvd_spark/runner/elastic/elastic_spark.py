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
import time
import uuid
from collections.abc import Callable, Sequence
from typing import IO, Any

import cloudpickle

from hvd_spark import _env
from hvd_spark.collectives.tcp.store import StoreServer
from hvd_spark.errors import ConfigError, ElasticJobError
from hvd_spark.runner import worker
from hvd_spark.runner.elastic import elastic_task
from hvd_spark.runner.elastic.elastic_driver import ElasticDriver
from hvd_spark.runner.elastic.elastic_job import FINISH_GRACE_S, ElasticJob, is_lost_peer_failure
from hvd_spark.runner.failures import WorkerFailure
from hvd_spark.runner.output import OutputForwarder
from hvd_spark.runner.run_config import ElasticConfig
from hvd_spark.runner.spark import spark_launcher
from hvd_spark.runner.spark.driver_service import LOG, STOP_KEY
from hvd_spark.runner.spark.job_thread import JobThread

log = logging.getLogger("hvd_spark.runner")

_POLL_S = 0.25


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


class ElasticSparkJob(ElasticJob):
    """One elastic run: its driver service, its Spark job of worker tasks, their supervision.

    Args:
        settings: Sizes and deadlines of the run.
        env: Variables for every worker.
        output: Receives the workers' output lines, prefixed with their task's partition.
        say: Receives one line for each membership change worth telling the user.
        spark: The session to run on (default: the active one).
    """

    def __init__(self, settings: ElasticConfig, env: dict[str, str] | None = None,
                 output: OutputForwarder | None = None,
                 say: Callable[[str], None] | None = None, spark: Any = None) -> None:
        super().__init__()
        self.spark = spark if spark is not None else spark_launcher.active_session()
        self.settings = settings
        self.num_proc = settings.num_proc
        self.secret = secrets.token_bytes(32)
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self._output = output or OutputForwarder(sys.stdout, sys.stderr)
        self.driver = ElasticDriver(settings, on_event=say or (lambda line: None))
        sc = spark_launcher.cluster_context(self.spark)
        bind_host, advertise_host = spark_launcher.driver_hosts(sc)
        self.server = StoreServer(self.secret, bind_host, {
            **self.driver.handlers(),
            LOG: self._on_log,
            worker.REPORT: self._on_report,
            elastic_task.WORKER_EXIT: self._on_exit,
        })
        self.run_id = uuid.uuid4().hex[:12]
        self.spec = elastic_task.ElasticTaskSpec(
            driver_addr=f"{advertise_host}:{self.server.port}", secret=self.secret,
            start_timeout_s=settings.start_timeout_s,
            elastic_timeout_s=settings.elastic_timeout_s,
            heartbeat_s=settings.heartbeat_s, env=dict(env or {}), run_id=self.run_id,
            respawn=task_attempts(self.spark) > 1)
        self._job = JobThread(self.spark, f"hvd_spark-elastic-{self.run_id}",
                              f"hvd_spark.run_elastic of up to {settings.max_np} ranks",
                              self._frame,
                              lambda error: self.events.put(("spark_done", "", error)))

    # ------------------------------------------------------------------ service handlers

    def _on_log(self, partition: int, lines: list[tuple[str, str]]) -> None:
        for stream, line in lines:
            self._output.write(partition, stream, line)

    def _on_report(self, rank: int, status: str, payload: Any, worker_id: str = "?") -> None:
        self.events.put(("report", worker_id, (rank, status, payload)))

    def _on_exit(self, worker_id: str, returncode: int) -> None:
        self.events.put(("exit", worker_id, returncode))

    # ------------------------------------------------------------------ the Launcher

    def _frame(self) -> Any:
        n = self.settings.max_np  # one task per worker slot
        return self.spark.range(n, numPartitions=n).mapInArrow(
            functools.partial(elastic_task.arrow_task, self.spec), elastic_task.OUTPUT_SCHEMA)

    def publish(self, payload: bytes) -> None:
        """Put the pickled function in the driver's store, where the workers fetch it."""
        self.server.set(worker.FN_KEY, payload)

    def start(self, command: Sequence[str] | None = None) -> None:
        """Submit the job of worker tasks in the background.

        Raises:
            ConfigError: ``command`` given: Spark tasks run the published function only.
        """
        if command is not None:
            raise ConfigError("Spark tasks run a Python function, not a command: publish "
                              "the function (hvd_spark.run_elastic)")
        self._job.start()

    def watch(self) -> list[WorkerFailure]:
        """Wait for the run's end; the failure of ``fn`` on a rank (not a lost peer), the
        others stopped, or [] when the final ring finished.

        Raises:
            ElasticJobError: Too few workers left, ``reset_limit`` reached, or the Spark
                job ended before training finished.
        """
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
                    self.failed = [payload]
                    self.stop()
                    return self.failed
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
                if done or time.monotonic() - finished_at > FINISH_GRACE_S:
                    return []

    def _lost(self) -> str:
        return "; ".join(f"worker {w} {why}" for w, why in self.driver.lost.items()) or "none"

    def stop(self) -> None:
        """Tell the workers' tasks to stop their workers, cancel the tasks still waiting."""
        self.server.set(STOP_KEY, True)
        self._job.cancel()
        self._job.join()

    def close(self) -> None:
        """Stop, then close the driver and its service."""
        self.driver.close()
        self.stop()
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
    err = stderr or sys.stderr

    def say(line: str) -> None:
        if verbose >= 1:
            err.write(f"hvd_spark.run_elastic: {line}\n")
            err.flush()
        log.info("run_elastic: %s", line)

    output = OutputForwarder(stdout or sys.stdout, err, timestamps=prefix_output_with_timestamp)
    with ElasticSparkJob(settings, user_env, output, say, spark) as job:
        return [cloudpickle.loads(result) for result in job.run(payload)]
