"""``hvd_spark.run``: run a function as the ranks of one job on Spark barrier tasks."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

import cloudpickle

from hvd_spark import _env
from hvd_spark.errors import ConfigError
from hvd_spark.runner import mlflow_inputs, worker
from hvd_spark.runner.console import verbose_logging
from hvd_spark.runner.run_config import RunConfig, horovod_keywords
from hvd_spark.runner.spark import spark_launcher
from hvd_spark.runner.spark.spark_launcher import SparkJob

__all__ = ["RunReport", "horovod_keywords", "run", "run_local", "run_with_report"]

log = logging.getLogger("hvd_spark.runner")


@dataclasses.dataclass(frozen=True)
class RunReport:
    """What one run returned, with the driver's timings (``time.time()`` seconds).

    Attributes:
        results: ``fn``'s return values, index = rank.
        hosts: Rank -> host it ran on.
        submitted_at: When the barrier job was submitted.
        first_registered_at: When the first task registered (tasks started).
        all_registered_at: When the last task registered and ranks were assigned.
        finished_at: When every result was in and the job had ended.
    """

    results: list
    hosts: dict[int, str]
    submitted_at: float
    first_registered_at: float
    all_registered_at: float
    finished_at: float


def run(
    fn: Callable,
    args: Sequence = (),
    kwargs: dict | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: int = 1,
    use_gpu: bool | None = None,
    prefix_output_with_timestamp: bool = False,
    extra_mpi_args: str | None = None,
    nics: Sequence[str] | str | None = None,
    executable: str | None = None,
    use_mpi: bool | None = None,
    use_gloo: bool | None = None,
    progress: Callable[[int, dict[str, Any]], None] | None = None,
    on_output: Callable[[int, str, str], None] | None = None,
    df: Any = None,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark barrier tasks; results in rank order.

    Each rank runs in a fresh child process of its task, with its rank's environment,
    so ``hvd_spark.collectives.init()`` (or a framework binding's) joins the ring.

    Args:
        fn: The function each rank runs (pickled with cloudpickle).
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        num_proc: Number of ranks; default: the number of tasks the cluster runs at once
            (its task slots, counting ``spark.task.cpus`` and GPUs per task).
        start_timeout: Seconds for all tasks to start and register; default
            ``HVD_SPARK_START_TIMEOUT``, else 600. As in Horovod, a started rank's imports
            do not count: its ``init()`` waits for slower peers as long as a collective.
        env: Variables added to every rank's environment.
        stdout: Stream receiving the ranks' stdout lines, prefixed ``[rank]``; default the
            driver's ``sys.stdout`` (a notebook cell shows them live).
        stderr: Likewise for their stderr lines; default the driver's ``sys.stderr``.
        verbose: 0 quiet, 1 log the start and end of the run, 2 also timings (``logging``).
        use_gpu: Show the ranks of each host that host's GPUs of the job as
            ``CUDA_VISIBLE_DEVICES``, each rank's own at device ``local_rank`` (its index in
            ``HVD_SPARK_GPU_INDEX``; see ``runner.gpu_mapping``); default: when
            ``spark.task.resource.gpu.amount`` is set. True on a session that schedules
            no GPUs is a ConfigError before anything starts.
        prefix_output_with_timestamp: Start each forwarded line with the time.
        extra_mpi_args: Horovod's keyword, accepted so that Horovod calls run unchanged;
            ignored with one log line (there is no MPI launcher under Spark).
        nics: One interface name, or several of which the first is used: sets
            ``HVD_SPARK_IFACE`` for the ranks.
        executable: Horovod's keyword; ignored with one log line (the ranks run in their
            task's Python, ``spark.pyspark.python``).
        use_mpi: Horovod's keyword; ignored with one log line (no MPI under Spark).
        use_gloo: Horovod's keyword: what always happens (our TCP ring plays Gloo's part).
        progress: Receives the structured progress events that training loops send
            (``hvd_spark.runner.progress_events.send``) as ``(rank, event)``, on a
            thread of the driver service; the Estimators draw them as a progress bar.
        on_output: Also receives every output line of the ranks as ``(rank, "stdout" or
            "stderr", line)``; the Estimators keep them as per-rank files in the Store.
        df: A DataFrame to train on, straight from Spark: the barrier tasks read its rows
            (dealt round-robin, one partition per rank) and each writes its share
            to its executor's local disk, where ``fn`` reads it
            (``hvd_spark.torch.dataframe_loader``, ``hvd_spark.tensorflow.dataframe_dataset``,
            or ``hvd_spark.data.RankShare.current()``). No Store, no shared filesystem;
            the shares are removed when the run ends, also when it fails.

    Returns:
        ``fn``'s return values, index = rank.

    Raises:
        ConfigError: No active SparkSession, too few task slots, dynamic allocation,
            something not picklable, or a bad argument.
        WorkerFailedError: A rank failed (root cause first, with its remote traceback);
            the other ranks were stopped and the Spark job cancelled.
        RendezvousTimeoutError: Not every task started within ``start_timeout``.
    """
    config = RunConfig.from_kwargs(
        num_proc=num_proc, start_timeout=start_timeout, env=env, stdout=stdout, stderr=stderr,
        verbose=verbose, use_gpu=use_gpu, prefix_output_with_timestamp=prefix_output_with_timestamp,
        extra_mpi_args=extra_mpi_args, nics=nics, executable=executable, use_mpi=use_mpi,
        use_gloo=use_gloo, progress=progress, on_output=on_output)
    return run_with_report(fn, args, kwargs, config, df).results


def run_with_report(fn: Callable, args: Sequence = (), kwargs: dict | None = None,
                    config: RunConfig | None = None, df: Any = None,
                    **options: Any) -> RunReport:
    """Run ``fn(*args, **kwargs)`` on Spark barrier tasks, with timings.

    Same as ``run`` but returns a ``RunReport`` (results, hosts, timings).

    Args:
        fn: The function each rank runs.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        config: The run's settings, built once (``RunConfig.from_kwargs``); with
            ``ranks_per_task`` each Spark task runs that many ranks (one per GPU of the
            task).
        df: As ``run``'s.
        **options: Instead of ``config``: ``hvd_spark.run``'s keywords.

    Raises:
        ConfigError: Both ``config`` and ``options``, or a bad option.
    """
    if config is not None and options:
        raise ConfigError(f"run_with_report: give config or {sorted(options)}, not both")
    if config is None:
        config = RunConfig.from_kwargs(**options)
    payload = worker.pickle_job(fn, args, kwargs)
    with verbose_logging(config.verbose):
        return _run_with_report(payload, config, df)


def _run_with_report(payload: bytes, config: RunConfig, df: Any = None) -> RunReport:
    config = SparkJob.prepare(config)  # num_proc's default comes from the cluster
    num_proc = config.num_proc
    assert num_proc is not None
    data = None
    if df is not None:
        if config.ranks_per_task != 1:
            raise ConfigError("df= needs one rank per Spark task (ranks_per_task=1): each "
                              "task hands its partition of the DataFrame to its rank")
        from hvd_spark.data.shares import prepare_shares  # pyarrow, pandas: only with df

        data = prepare_shares(df, num_proc)  # the columns are checked before anything runs
        mlflow_inputs.log_dataframe_input(df)  # with an active MLflow run: its lineage
    level = logging.INFO if config.verbose >= 1 else logging.DEBUG
    started = time.monotonic()
    with SparkJob(config, data) as job:
        job.publish(payload)
        log.log(level, "hvd_spark.run: starting %d ranks (job group %s, service %s)",
                num_proc, job.job_group, job.service.addr)
        submitted_at = time.time()
        job.start()
        payloads = job.wait()
        service = job.service
        report = RunReport(
            results=[cloudpickle.loads(p) for p in payloads],
            hosts=service.hosts,
            submitted_at=submitted_at,
            first_registered_at=service.first_registered_at or submitted_at,
            all_registered_at=service.all_registered_at or submitted_at,
            finished_at=time.time(),
        )
    if config.verbose >= 2:
        log.info("hvd_spark.run: tasks started %.3f s after submission, all registered "
                 "%.3f s later", report.first_registered_at - submitted_at,
                 report.all_registered_at - report.first_registered_at)
    log.log(level, "hvd_spark.run: %d ranks finished in %.2f s", num_proc,
            time.monotonic() - started)
    return report


def run_local(
    fn: Callable,
    args: Sequence = (),
    kwargs: dict | None = None,
    num_proc: int | None = None,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    df: Any = None,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` local processes; results in rank order.

    As ``hvd_spark.runner.local.local_launcher.run_local`` (no Spark needed), and with
    ``df`` as ``run``'s: each rank reads its share of the DataFrame from a local file
    (``dataframe_loader``, ...), written by one Spark job of the active session, whose
    master must be local (its executors write where the ranks read); the files are
    removed when the ranks end.

    Raises:
        ConfigError: Bad arguments, or ``df`` without a local Spark master.
        DataError: A column no model can take, or fewer rows than ranks.
        WorkerFailedError: A rank failed; the others were stopped.
    """
    from hvd_spark.runner.local import local_launcher

    if df is None:
        return local_launcher.run_local(fn, args, kwargs, num_proc, env, stdout, stderr)
    import shutil
    import tempfile

    from hvd_spark.data.shares import write_local_shares

    sc = spark_launcher.cluster_context(spark_launcher.active_session())
    if not sc.master.startswith("local"):
        raise ConfigError(
            f"run_local(df=...) writes the shares where this machine's ranks read them, so its "
            f"Spark master must be local, not {sc.master!r}: use hvd_spark.run(fn, df=df) to "
            "train on the cluster's executors")
    num_proc = num_proc if num_proc is not None else spark_launcher.task_slots(sc)
    directory = tempfile.mkdtemp(prefix="hvd_spark-shares-")
    try:
        shares = write_local_shares(df, num_proc, directory)
        mlflow_inputs.log_dataframe_input(df)
        least = str(min(rows for _, rows in shares))
        rank_envs = [{_env.SHARE_PATH: path, _env.SHARE_MIN_ROWS: least} for path, _ in shares]
        return local_launcher.run_local(fn, args, kwargs, num_proc, env, stdout, stderr,
                                        rank_envs=rank_envs)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
