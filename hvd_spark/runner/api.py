"""``hvd_spark.run``: run a function as the ranks of one job on Spark barrier tasks."""

from __future__ import annotations

import dataclasses
import logging
import secrets
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import IO, Any

import cloudpickle

from hvd_spark import _env
from hvd_spark.errors import ConfigError
from hvd_spark.runner import mlflow_env, mlflow_inputs, worker
from hvd_spark.runner.console import verbose_logging
from hvd_spark.runner.output import OutputForwarder
from hvd_spark.runner.run_config import RunConfig
from hvd_spark.runner.spark import spark_launcher
from hvd_spark.runner.spark.driver_service import DriverService
from hvd_spark.runner.spark.spark_task import TaskSpec

log = logging.getLogger("hvd_spark.runner")


def horovod_keywords(env: dict[str, str] | None, *, extra_mpi_args: str | None,
                     nics: Sequence[str] | str | None, executable: str | None,
                     use_mpi: bool | None, use_gloo: bool | None) -> dict[str, str] | None:
    """Apply Horovod's launcher keywords that mean something here; log the others once.

    Returns ``env``, with ``HVD_SPARK_IFACE`` added when ``nics`` names an interface.
    """
    if use_mpi and use_gloo:
        raise ConfigError("use_mpi and use_gloo are both True; Horovod accepts one at most")
    if use_mpi:
        log.info("hvd_spark.run: use_mpi=True is ignored: under Spark the ranks always "
                 "connect through hvd_spark's TCP ring (there is no mpirun to start)")
    if use_gloo is False and not use_mpi:
        log.info("hvd_spark.run: use_gloo=False is ignored: the TCP ring is the only "
                 "controller under Spark")
    if extra_mpi_args:
        log.info("hvd_spark.run: extra_mpi_args=%r is ignored: no MPI launcher runs under "
                 "Spark", extra_mpi_args)
    if executable is not None:
        log.info("hvd_spark.run: executable=%r is ignored: each rank runs in its Spark "
                 "task's Python (set spark.pyspark.python or PYSPARK_PYTHON)", executable)
    if nics:
        names = [nics] if isinstance(nics, str) else sorted(nics)
        bad = [n for n in names if not isinstance(n, str) or not n]
        if bad:
            raise ConfigError(f"nics must be interface names (str), got {nics!r}")
        if len(names) > 1:
            log.info("hvd_spark.run: nics=%r: the ranks advertise the address of %r "
                     "(one interface is used)", nics, names[0])
        env = {**(env or {}), _env.IFACE: names[0]}
    return env


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
            (repartitioned round-robin, one partition per rank) and each writes its share
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
    env = horovod_keywords(env, extra_mpi_args=extra_mpi_args, nics=nics,
                           executable=executable, use_mpi=use_mpi, use_gloo=use_gloo)
    return run_with_report(
        fn, args=args, kwargs=kwargs, num_proc=num_proc, start_timeout=start_timeout, env=env,
        stdout=stdout, stderr=stderr, verbose=verbose, use_gpu=use_gpu,
        prefix_output_with_timestamp=prefix_output_with_timestamp, progress=progress,
        on_output=on_output, df=df,
    ).results


def run_with_report(
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
    progress: Callable[[int, dict[str, Any]], None] | None = None,
    on_output: Callable[[int, str, str], None] | None = None,
    ranks_per_task: int = 1,
    df: Any = None,
) -> RunReport:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark barrier tasks, with timings.

    Same as ``run`` but returns a ``RunReport`` (results, hosts, timings); with
    ``ranks_per_task`` each Spark task runs that many ranks (one per GPU of the task).
    """
    payload = worker.pickle_job(fn, args, kwargs)
    config = RunConfig.from_kwargs(
        num_proc=num_proc, start_timeout=start_timeout, env=env, stdout=stdout, stderr=stderr,
        verbose=verbose, use_gpu=use_gpu, prefix_output_with_timestamp=prefix_output_with_timestamp,
        progress=progress, on_output=on_output, ranks_per_task=ranks_per_task)
    with verbose_logging(verbose):
        return _run_with_report(payload, config, df)


def _run_with_report(payload: bytes, config: RunConfig, df: Any = None) -> RunReport:
    # The driver's MLflow run reaches the ranks; the caller's env wins over it.
    user_env = {**mlflow_env.driver_env(), **config.env}
    timeout = config.timeouts.start_timeout
    spark = spark_launcher.active_session()
    sc = spark_launcher.cluster_context(spark)  # a SparkContext, or its Connect stand-in
    # Default: every task slot, as many ranks as the cluster runs at once.
    per_task = config.ranks_per_task
    num_proc = (spark_launcher.task_slots(sc) * per_task if config.num_proc is None
                else config.num_proc)
    config = config.with_num_proc(num_proc)  # checked again: the default comes from Spark
    gpu = spark_launcher.resolve_use_gpu(sc, config.use_gpu)
    spark_launcher.check_cluster(sc, num_proc // per_task)
    data = None
    if df is not None:
        if per_task != 1:
            raise ConfigError("df= needs one rank per Spark task (ranks_per_task=1): each "
                              "task hands its partition of the DataFrame to its rank")
        from hvd_spark.data.shares import prepare_shares  # pyarrow, pandas: only with df

        data = prepare_shares(df, num_proc)  # the columns are checked before anything runs
        mlflow_inputs.log_dataframe_input(df)  # with an active MLflow run: its lineage
    bind_host, advertise_host = spark_launcher.driver_hosts(sc)
    level = logging.INFO if config.verbose >= 1 else logging.DEBUG
    output = OutputForwarder(config.stdout or sys.stdout, config.stderr or sys.stderr,
                             timestamps=config.prefix_output_with_timestamp,
                             tee=config.on_output)
    secret = secrets.token_bytes(32)
    started = time.monotonic()
    with DriverService(num_proc, secret, bind_host, advertise_host, output,
                       progress=config.progress) as service:
        spec = TaskSpec(service.addr, secret, timeout, user_env, gpu, uuid.uuid4().hex[:12],
                        ranks_per_task=per_task, with_share=data is not None)
        launch = spark_launcher.SparkLaunch(spark, service, spec, config.timeouts, data)
        launch.publish(payload)
        log.log(level, "hvd_spark.run: starting %d ranks (job group %s, service %s)",
                num_proc, launch.job_group, service.addr)
        submitted_at = time.time()
        launch.start()
        payloads = launch.wait()
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
