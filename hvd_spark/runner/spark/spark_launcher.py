"""The Spark side of ``hvd_spark.run``: checks, the barrier job, and its supervision.

The barrier job runs in a background thread under its own job group (a job tag on
Spark Connect), so the driver can cancel it the moment a rank fails; meanwhile the
calling thread consumes the events of the run's ``DriverService`` and decides when it
is over. A classic session's SparkContext and a Connect session's ``ConnectContext``
answer the same questions (master, parallelism, configuration).
pyspark is imported inside functions so ``import hvd_spark.runner`` never needs it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import re
import secrets
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

from hvd_spark.errors import (
    ConfigError,
    HvdSparkError,
    RendezvousTimeoutError,
    WorkerFailedError,
)
from hvd_spark.runner import mlflow_env
from hvd_spark.runner.failures import WorkerFailure
from hvd_spark.runner.heartbeat_monitor import hearing_grace
from hvd_spark.runner.launcher import Launcher
from hvd_spark.runner.output import OutputForwarder
from hvd_spark.runner.run_config import RunConfig
from hvd_spark.runner.spark import spark_task, task_loss
from hvd_spark.runner.spark.connect import ConnectContext, is_connect
from hvd_spark.runner.spark.driver_service import DriverService
from hvd_spark.runner.spark.job_thread import JobThread
from hvd_spark.runner.worker import FN_KEY

log = logging.getLogger(__name__)

# Stopped ranks exit within the stop grace (their task reaps them); a task that vanished
# never does, and Spark's verdict on it (executor lost) takes this much longer to end the job.
_SPARK_VERDICT_S = 7.0
_SLOT_WAIT_S = 15.0
_POLL_S = 0.2


def active_session() -> Any:
    """Return the active SparkSession (classic or Spark Connect), or raise a ConfigError
    saying how to get one."""
    try:
        from pyspark import SparkContext
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise ConfigError(
            "hvd_spark.run needs pyspark: pip install 'hvd-spark[spark]' (or use "
            "hvd_spark.run_local to run without Spark)") from exc
    session = SparkSession.getActiveSession()
    # The active session is thread-local in the JVM; another driver thread sees none,
    # but the process's SparkContext is still there to attach to.
    if session is None and SparkContext._active_spark_context is not None:
        session = SparkSession.builder.getOrCreate()
    if session is None:
        raise ConfigError(
            "hvd_spark.run needs an active SparkSession: create one first with "
            "SparkSession.builder.getOrCreate() (or use hvd_spark.run_local without Spark)")
    return session


def cluster_context(session: Any) -> Any:
    """The SparkContext of a classic session, a ``ConnectContext`` for Spark Connect."""
    return ConnectContext(session) if is_connect(session) else session.sparkContext


def _conf(sc: Any, key: str, default: str) -> str:
    return sc.getConf().get(key, default)


def _is_local(sc: Any) -> bool:
    return sc.master.startswith("local")


def task_slots(sc: Any) -> int:
    """How many tasks the cluster can run at once (what a barrier stage needs), counting
    ``spark.task.cpus`` and, with GPU scheduling, the GPUs each task takes."""
    task_cpus = int(_conf(sc, "spark.task.cpus", "1"))
    match = re.fullmatch(r"local-cluster\[(\d+),\s*(\d+),\s*\d+\]", sc.master)
    if match:
        per_executor = int(match.group(2)) // task_cpus
        task_gpus = float(_conf(sc, "spark.task.resource.gpu.amount", "0") or 0)
        if task_gpus > 0:
            executor_gpus = float(_conf(sc, "spark.executor.resource.gpu.amount", "0") or 0)
            per_executor = min(per_executor, int(executor_gpus / task_gpus))
        return int(match.group(1)) * per_executor
    if _is_local(sc):
        return sc.defaultParallelism // task_cpus
    try:  # what Spark's own barrier check uses; private API, hence the fallback
        jsc = sc._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(
            jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - fall back to the public estimate
        return sc.defaultParallelism // task_cpus


def resolve_use_gpu(sc: Any, use_gpu: bool | None) -> bool:
    """``use_gpu=None`` means: if Spark schedules GPUs to tasks.

    Raises:
        ConfigError: ``use_gpu=True`` on a session that schedules no GPUs (checked before
            anything starts), naming the Spark settings that would.
    """
    amount = _conf(sc, "spark.task.resource.gpu.amount", "")
    if use_gpu is None:
        return bool(amount)
    if use_gpu and not amount:
        raise ConfigError(
            "hvd_spark.run(use_gpu=True), but this Spark session schedules no GPUs to tasks "
            "(spark.task.resource.gpu.amount is not set), so no rank would know its GPU: "
            "start the session with spark.executor.resource.gpu.amount (GPUs per executor), "
            "spark.executor.resource.gpu.discoveryScript (a script printing the executor's "
            "GPU addresses, e.g. Spark's getGpusResources.sh) and "
            "spark.task.resource.gpu.amount (GPUs per task: 1, or 0.5 to share one), or pass "
            "use_gpu=False to run without GPUs")
    return use_gpu


def check_cluster(sc: Any, num_proc: int) -> None:
    """Fail before launching when a barrier stage of ``num_proc`` tasks cannot run."""
    if not _is_local(sc) and _conf(sc, "spark.dynamicAllocation.enabled", "false") == "true":
        raise ConfigError(
            "Spark barrier mode does not work with dynamic allocation: start the session with "
            "spark.dynamicAllocation.enabled=false and a fixed number of executors")
    slots = task_slots(sc)
    deadline = time.monotonic() + (0 if _is_local(sc) else _SLOT_WAIT_S)
    while slots < num_proc and time.monotonic() < deadline:
        time.sleep(0.5)  # executors may still be registering
        slots = task_slots(sc)
    if num_proc > slots:
        raise ConfigError(
            f"num_proc={num_proc} but the cluster runs at most {slots} tasks at once "
            f"(master {sc.master}, spark.task.cpus={_conf(sc, 'spark.task.cpus', '1')}): "
            "lower num_proc, or add executors/cores; all ranks must run at the same time")


def driver_hosts(sc: Any) -> tuple[str, str]:
    """(interface to bind, address tasks dial) for the driver's service."""
    if isinstance(sc, ConnectContext):
        return sc.driver_hosts()  # the service runs in this client, not in Spark's driver
    if _is_local(sc):
        return "127.0.0.1", "127.0.0.1"  # executors run on this machine
    host = _conf(sc, "spark.driver.host", "")
    if not host:
        raise ConfigError("spark.driver.host is not set; cannot tell executors where to connect")
    return _conf(sc, "spark.driver.bindAddress", host), host


@dataclasses.dataclass
class _Outcome:
    results: dict[int, bytes] = dataclasses.field(default_factory=dict)
    failures: dict[int, WorkerFailure] = dataclasses.field(default_factory=dict)
    exited: set[int] = dataclasses.field(default_factory=set)
    spark_error: BaseException | None = None
    spark_done: bool = False
    silent: set[int] = dataclasses.field(default_factory=set)
    stop_at: float | None = None  # a rank fell silent: the others hear why until then


class SparkJob(Launcher):
    """One barrier job running ``config.num_proc`` ranks, supervised from the driver.

    It runs the job's ``DriverService`` (which the tasks register with) until ``close``.

    Args:
        config: The run's settings (``prepare`` resolves a missing ``num_proc``).
        data: With ``run(fn, df=...)``, the DataFrame in ``num_proc`` partitions
            (``data.shares.prepare_shares``): the barrier stage runs over it.
        spark: The session to run on (default: the active one).
    """

    def __init__(self, config: RunConfig, data: Any = None, spark: Any = None) -> None:
        self.spark = spark if spark is not None else active_session()
        sc = cluster_context(self.spark)
        if config.num_proc is None:
            config = self.prepare(config)
        self.config = config
        self.timeouts = config.timeouts
        self.num_proc: int = config.num_proc  # type: ignore[assignment]
        self.data = data
        bind_host, advertise_host = driver_hosts(sc)
        output = OutputForwarder(config.stdout or sys.stdout, config.stderr or sys.stderr,
                                 timestamps=config.prefix_output_with_timestamp,
                                 tee=config.on_output)
        secret = secrets.token_bytes(32)
        self.service = DriverService(self.num_proc, secret, bind_host, advertise_host, output,
                                     progress=config.progress)
        # The driver's MLflow run reaches the ranks; the caller's env wins over it. The
        # ranks beat to the driver service: a frozen rank or a host cut off fails the run
        # within the heartbeat limit, not the collective timeout.
        self.spec = spark_task.TaskSpec(
            driver_addr=self.service.addr, secret=secret,
            start_timeout_s=self.timeouts.start_timeout_s, heartbeat_s=self.timeouts.heartbeat_s,
            env={**mlflow_env.driver_env(), **config.env}, run_id=uuid.uuid4().hex[:12],
            use_gpu=resolve_use_gpu(sc, config.use_gpu), ranks_per_task=config.ranks_per_task,
            with_share=data is not None)
        self.service.watch_heartbeats(self.timeouts.heartbeat_s)
        self.job_group = f"hvd_spark-{self.spec.run_id}"
        self._job = JobThread(self.spark, self.job_group,
                              f"hvd_spark.run of {self.num_proc} ranks", self._frame,
                              lambda error: self.service.events.put(("spark_done", -1, error)))
        self._outcome = _Outcome()
        self._failures: list[WorkerFailure] = []
        self._results: list[bytes] = []

    @classmethod
    def prepare(cls, config: RunConfig) -> RunConfig:
        """``config`` with ``num_proc`` (default: every task slot, times ``ranks_per_task``)
        and ``use_gpu`` resolved, checked against the active session's cluster.

        Raises:
            ConfigError: No session, dynamic allocation, too few task slots, or
                ``use_gpu=True`` without GPU scheduling.
        """
        sc = cluster_context(active_session())
        per_task = config.ranks_per_task
        num_proc = task_slots(sc) * per_task if config.num_proc is None else config.num_proc
        config = dataclasses.replace(config, num_proc=num_proc,
                                     use_gpu=resolve_use_gpu(sc, config.use_gpu))
        check_cluster(sc, num_proc // per_task)
        return config

    @classmethod
    def capacity(cls, config: RunConfig) -> int | None:
        """Ranks the executors alive now can run (a lost executor no longer counts)."""
        sc = cluster_context(active_session())
        if not sc.master.startswith("local-cluster") and _is_local(sc):
            return task_slots(sc) * config.ranks_per_task  # one JVM: nothing to lose
        try:  # what Spark's barrier check counts; private API, hence the fallback
            jsc = sc._jsc.sc()
            slots = int(jsc.maxNumConcurrentTasks(
                jsc.resourceProfileManager().defaultResourceProfile()))
        except Exception:  # noqa: BLE001 - Spark Connect or another Spark: the static count
            slots = task_slots(sc)
        return slots * config.ranks_per_task

    def publish(self, payload: bytes) -> None:
        """Put the pickled function in the driver service, where the ranks fetch it."""
        self.service.set(FN_KEY, payload)

    def _frame(self) -> Any:
        n = self.num_proc // self.spec.ranks_per_task  # one task per ranks_per_task ranks
        frame = self.spark.range(n, numPartitions=n) if self.data is None else self.data
        try:
            return frame.mapInArrow(functools.partial(spark_task.arrow_task, self.spec),
                                    spark_task.OUTPUT_SCHEMA, barrier=True)
        except TypeError:  # Spark < 3.5: no barrier DataFrame API
            rdd = self.spark.sparkContext.parallelize(range(n), n).barrier()
            return rdd.mapPartitions(functools.partial(spark_task.rdd_task, self.spec))

    def start(self, command: Sequence[str] | None = None) -> None:
        """Submit the barrier job in a background thread with its own job group.

        Raises:
            ConfigError: ``command`` given: Spark tasks run the published function only.
        """
        if command is not None:
            raise ConfigError("Spark tasks run a Python function, not a command: publish "
                              "the function (hvd_spark.run) or start commands with hvdrun")
        self._job.start()

    def wait(self) -> list[bytes]:
        """Supervise the run; return the pickled results in rank order.

        Raises:
            WorkerFailedError: A rank failed; the others were stopped, the job cancelled.
            RendezvousTimeoutError: Not every task started within ``start_timeout``.
            HvdSparkError: The Spark job failed before the ranks could report.
        """
        failures = self.watch()
        if failures:
            raise WorkerFailedError(failures)
        return self.collect()

    def collect(self) -> list[bytes]:
        """The pickled results in rank order, after ``watch``.

        Raises:
            WorkerFailedError: A rank failed.
        """
        if self._failures:
            raise WorkerFailedError(self._failures)
        return list(self._results)

    def stop(self) -> None:
        """Tell the ranks to stop, cancel the job if it still runs, wait for it (bounded)."""
        self._finish(self._outcome)

    def close(self) -> None:
        """Stop, then close the driver service."""
        try:
            self.stop()
        finally:
            self.service.close()

    def watch(self) -> list[WorkerFailure]:
        """Supervise the run until every rank reported or one failed; return the failures.

        Raises:
            RendezvousTimeoutError: Not every task started within ``start_timeout``.
            HvdSparkError: The Spark job failed before the ranks could report.
        """
        outcome = self._outcome
        try:
            self._supervise(outcome)
        finally:
            self._finish(outcome)
        self._drain(outcome)
        verdict = (task_loss.read_verdict(outcome.spark_error)
                   if outcome.spark_error is not None else None)
        if verdict is not None and verdict.partition is not None:
            # A task's ranks register as slots partition * ranks_per_task + i.
            verdict = dataclasses.replace(
                verdict, partition=verdict.partition * self.spec.ranks_per_task)
        # A task that vanished (its executor lost) never reports: Spark's verdict names it.
        # Tasks that failed before every rank was assigned are a setup problem (below).
        if verdict is not None and (self.service.ranks or verdict.executor is not None):
            outcome.failures = task_loss.lost_task_failures(
                verdict, outcome.failures, set(outcome.results) | outcome.exited,
                self.service.ranks, self.num_proc)
        if outcome.failures:
            self._failures = list(outcome.failures.values())
            return self._failures
        if len(outcome.results) < self.num_proc:
            missing = sorted(set(range(self.num_proc)) - set(outcome.results))
            raise HvdSparkError(
                f"the Spark barrier job ended without results from ranks {missing}: "
                f"{outcome.spark_error}. Check that the executors' Python (PYSPARK_PYTHON, "
                "spark.pyspark.python) is the same version as the driver's and has hvd_spark "
                "and its dependencies installed, and the executor logs for a crash"
            ) from outcome.spark_error
        self._results = [outcome.results[r] for r in range(self.num_proc)]
        return []

    @property
    def _teardown_s(self) -> float:
        return self.timeouts.stop_grace_s + _SPARK_VERDICT_S

    def _supervise(self, out: _Outcome) -> None:
        start_timeout_s = self.timeouts.start_timeout_s
        start_deadline = time.monotonic() + start_timeout_s
        teardown_at: float | None = None
        while len(out.results) < self.num_proc or out.failures:
            if teardown_at is not None and (
                    len(out.exited) >= self.num_proc or out.spark_done
                    or time.monotonic() - teardown_at > self._teardown_s):
                return
            if out.spark_done and teardown_at is None:
                return  # the job ended (or failed) with nothing left to wait for
            if (teardown_at is None and self.service.all_registered_at is None
                    and time.monotonic() > start_deadline):
                raise RendezvousTimeoutError(
                    f"only {self.service.registered} of {self.num_proc} Spark tasks started "
                    f"within start_timeout={start_timeout_s} s: other jobs may hold the task "
                    "slots, or executors are missing; free them or raise start_timeout")
            try:
                kind, key, value = self.service.events.get(timeout=_POLL_S)
            except queue.Empty:
                pass
            else:
                self._apply(out, kind, key, value, torn_down=teardown_at is not None)
            if out.failures and teardown_at is None and self._stop_now(out):
                teardown_at = time.monotonic()
                self.service.stop()

    def _stop_now(self, out: _Outcome) -> bool:
        """Whether to stop the ranks after a failure: at once, or after a silent rank's
        peers heard why (or ended)."""
        if out.stop_at is None or time.monotonic() >= out.stop_at:
            return True
        return all(r in out.exited or r in out.silent for r in range(self.num_proc))

    def _apply(self, out: _Outcome, kind: str, key: int, value: Any, torn_down: bool) -> None:
        host = self.service.hosts.get(key, "?")
        if kind == "report" and value[0] == "ok":
            out.results[key] = value[1]
        elif kind == "report":
            out.failures.setdefault(key, value[1])
        elif kind == "exit":
            returncode, stopped = value
            out.exited.add(key)
            if key not in out.failures and (returncode != 0 or key not in out.results):
                out.failures[key] = WorkerFailure.from_exit(key, host, returncode, stopped)
        elif kind == "task_error":
            if torn_down:
                value = dataclasses.replace(value, secondary=True)
            out.failures.setdefault(key, value)
        elif kind == "silent":
            failure = WorkerFailure(key, host, (
                f"rank {key} sent no heartbeat for {value:.0f} s: its process or executor froze "
                "or died, or its host is unreachable"), lost=True)
            out.failures.setdefault(key, failure)
            out.silent.add(key)
            self.service.abort_ranks(failure.message)
            if out.stop_at is None:  # the others hear why, fail with it and report it
                out.stop_at = time.monotonic() + hearing_grace(self.timeouts.heartbeat_s)
        elif kind == "spark_done":
            out.spark_done, out.spark_error = True, value

    def _drain(self, out: _Outcome) -> None:
        """Apply the events that arrived while the run was stopped (the job's end, exits)."""
        while True:
            try:
                kind, key, value = self.service.events.get_nowait()
            except queue.Empty:
                return
            self._apply(out, kind, key, value, torn_down=True)

    def _finish(self, out: _Outcome) -> None:
        """Stop the ranks, cancel the job if it still runs, and wait for it (bounded)."""
        self.service.stop()
        if not out.spark_done and (out.failures or len(out.results) < self.num_proc):
            self._job.cancel()
        self._job.join()
