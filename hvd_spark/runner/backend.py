"""Backends: where an Estimator's training function runs (Horovod's ``Backend`` API).

``SparkBackend`` runs it with ``hvd_spark.run`` on Spark barrier tasks; a custom
``Backend`` can run it somewhere else (a test double, another cluster manager), as in
Horovod, by implementing ``run`` and ``num_processes``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import IO, Any

from hvd_spark.errors import ConfigError

log = logging.getLogger("hvd_spark.runner")


class Backend:
    """Runs a training function on every rank; subclass it for another launcher."""

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None,
            env: dict[str, str] | None = None) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Args:
            fn: The function each rank runs.
            args: Its positional arguments.
            kwargs: Its keyword arguments.
            env: Variables added to every rank's environment (on top of the backend's).
        """
        raise NotImplementedError

    def num_processes(self) -> int:
        """Number of ranks ``run`` starts."""
        raise NotImplementedError


class SparkBackend(Backend):
    """Runs training with ``hvd_spark.run`` on Spark barrier tasks.

    Args:
        num_proc: Number of ranks; default: the active SparkContext's
            the cluster's task slots, read when first needed.
        env: Variables added to every rank's environment. Unlike Horovod, the ranks
            always inherit their executor's environment, so the driver's ``os.environ``
            is not copied over (it would carry driver-only paths to the executors).
        stdout: Stream receiving the ranks' stdout lines, prefixed ``[rank]``.
        stderr: Stream receiving the ranks' stderr lines, prefixed ``[rank]``.
        prefix_output_with_timestamp: Start each forwarded line with the time.
        verbose: 0 quiet, 1 the start and end of the run, 2 also timings.
        start_timeout: Seconds for every task to start and the ranks to connect.
        use_gpu: Show each rank its host's GPUs of the job, its own at ``local_rank``
            (``hvd_spark.run``'s); default: when Spark schedules GPUs.
        **run_kwargs: Any other keyword of ``hvd_spark.run`` (Horovod's ``use_gloo``,
            ``use_mpi``, ``extra_mpi_args``, ``nics``, ``executable`` included).
    """

    def __init__(self, num_proc: int | None = None, env: dict[str, str] | None = None,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None,
                 prefix_output_with_timestamp: bool = False, verbose: int = 1,
                 start_timeout: float | None = None, use_gpu: bool | None = None,
                 **run_kwargs: Any) -> None:
        if num_proc is not None and (not isinstance(num_proc, int) or num_proc < 1):
            raise ConfigError(f"SparkBackend: num_proc must be a positive integer, got "
                              f"{num_proc!r}")
        if env is not None and not isinstance(env, dict):
            raise ConfigError(f"SparkBackend: env must be a dict of str to str, got "
                              f"{type(env).__name__}")
        from hvd_spark.runner.api import run

        known = set(run.__code__.co_varnames[: run.__code__.co_argcount])
        unknown = sorted(set(run_kwargs) - known)
        if unknown:
            raise ConfigError(f"SparkBackend got unknown keyword(s) {unknown}; hvd_spark.run "
                              f"takes {sorted(known - {'fn', 'args', 'kwargs'})}")
        self._num_proc = num_proc
        self._env = dict(env or {})
        self._run_kwargs = dict(run_kwargs, stdout=stdout, stderr=stderr,
                                prefix_output_with_timestamp=prefix_output_with_timestamp,
                                verbose=verbose, start_timeout=start_timeout, use_gpu=use_gpu)

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None,
            env: dict[str, str] | None = None, df: Any = None) -> list:
        """As ``Backend.run``; ``df``: a DataFrame whose partitions the ranks' tasks hand
        to them (``hvd_spark.run``'s ``df``)."""
        from hvd_spark.runner.api import run

        full_env = {**self._env, **(env or {})}
        return run(fn, args=args, kwargs=kwargs, num_proc=self.num_processes(), env=full_env,
                   df=df, **self._run_kwargs)

    def num_processes(self) -> int:
        if self._num_proc is None:
            from hvd_spark.runner.spark.spark_launcher import (
                active_session,
                cluster_context,
                task_slots,
            )

            self._num_proc = task_slots(cluster_context(active_session()))
        return self._num_proc

    def available_slots(self) -> int:
        """Task slots of the executors alive now (a lost executor no longer counts)."""
        from hvd_spark.runner.spark.spark_launcher import (
            active_session,
            cluster_context,
            task_slots,
        )

        sc = cluster_context(active_session())
        if not sc.master.startswith("local-cluster") and sc.master.startswith("local"):
            return task_slots(sc)  # one JVM: nothing to lose
        try:  # what Spark's barrier check counts; private API, hence the fallback
            jsc = sc._jsc.sc()
            return int(jsc.maxNumConcurrentTasks(
                jsc.resourceProfileManager().defaultResourceProfile()))
        except Exception:  # noqa: BLE001 - Spark Connect or another Spark: the static count
            return task_slots(sc)

    def with_num_proc(self, num_proc: int) -> SparkBackend:
        """A copy that runs ``num_proc`` ranks (a retry with the executors that remain)."""
        copy = self.with_options()
        copy._num_proc = num_proc
        return copy

    def with_options(self, **options: Any) -> SparkBackend:
        """A copy whose ``hvd_spark.run`` keywords are updated where ``options`` are not None.

        The Estimators use it to pass their ``verbose``/``stdout`` without changing the
        user's backend object.
        """
        copy = SparkBackend.__new__(SparkBackend)
        copy._num_proc, copy._env = self._num_proc, dict(self._env)
        copy._run_kwargs = dict(self._run_kwargs)
        for key, value in options.items():
            if value is not None and copy._run_kwargs.get(key) is None:
                copy._run_kwargs[key] = value
        return copy
