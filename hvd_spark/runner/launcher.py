"""The one seam for starting ranks: publish the job, start the ranks, watch, stop, collect.

Every way of starting ranks implements it: Spark barrier tasks
(``spark.spark_launcher.SparkJob``), local processes (``local.local_launcher.LocalJob``),
hosts over ssh (``local.ssh_launcher.SshJob``), ``mpirun`` (``local.mpi_launcher.MpiJob``)
and the elastic jobs (``elastic.elastic_local.ElasticLocalJob``,
``elastic.elastic_spark.ElasticSparkJob``). Each is built from one ``RunConfig`` (the
elastic ones from an ``ElasticConfig``). Whatever starts the ranks, the caller sees the
same thing: results in rank order, a failing rank's traceback naming the rank, and every
rank process gone within a deadline once ``stop`` returns.
``tests/contract/test_launcher_contract.py`` checks all of them. ``hvd_spark.run``,
``hvdrun`` and the Estimators (through ``backend.LauncherBackend``) start ranks only
through it.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Sequence

import cloudpickle

from hvd_spark.errors import WorkerFailedError
from hvd_spark.runner import worker
from hvd_spark.runner.failures import WorkerFailure
from hvd_spark.runner.run_config import RunConfig


class Launcher(abc.ABC):
    """One job's ranks, started and seen through by one launcher.

    Use it as a context manager (leaving it stops every rank), or call the steps:
    ``publish`` the pickled function, ``start`` the ranks, ``watch`` until they end,
    then ``collect`` their results.

    Attributes:
        num_proc: Number of ranks.
    """

    num_proc: int

    @classmethod
    def prepare(cls, config: RunConfig) -> RunConfig:
        """``config`` checked against where this launcher starts ranks, ``num_proc``
        resolved (here: the machine's CPUs); called before anything expensive starts.

        Raises:
            ConfigError: The launcher cannot run ``config`` (too few slots, ...).
        """
        return config if config.num_proc is not None else config.with_num_proc(
            os.cpu_count() or 1)

    @classmethod
    def capacity(cls, config: RunConfig) -> int | None:
        """How many ranks it could start now (None: no bound it knows of); a retry after
        a lost rank waits for, or shrinks to, this many."""
        return None

    @abc.abstractmethod
    def publish(self, payload: bytes) -> None:
        """Hand the ranks the pickled ``(fn, args, kwargs)`` (``worker.pickle_job``)."""

    @abc.abstractmethod
    def start(self, command: Sequence[str] | None = None) -> None:
        """Start every rank: the published function, or ``command`` where it can run one.

        Raises:
            ConfigError: The launcher runs functions only and was given a command.
        """

    @abc.abstractmethod
    def watch(self) -> list[WorkerFailure]:
        """Wait until every rank has ended; return the failures (empty when all succeeded).

        When one rank fails, the others are stopped, so this returns soon after.
        """

    @abc.abstractmethod
    def stop(self) -> None:
        """End every rank process now (and within ``Timeouts.stop_grace_s`` plus a few
        seconds); safe to call more than once."""

    @abc.abstractmethod
    def collect(self) -> list[bytes]:
        """The ranks' pickled results in rank order, after ``watch``.

        Raises:
            WorkerFailedError: A rank failed (root cause first, with its traceback).
        """

    def close(self) -> None:
        """Stop the ranks and release what the launcher holds (its service or store)."""
        self.stop()

    def run(self, payload: bytes) -> list[bytes]:
        """Publish, start, watch and collect: the pickled results in rank order.

        Raises:
            WorkerFailedError: A rank failed; the others were stopped.
        """
        self.publish(payload)
        self.start()
        failures = self.watch()
        if failures:
            raise WorkerFailedError(failures)
        return self.collect()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_function(launcher: Callable[[RunConfig], Launcher], config: RunConfig,
                 fn: Callable, args: Sequence = (), kwargs: dict | None = None) -> list:
    """Run ``fn(*args, **kwargs)`` as the ranks of one job of ``launcher(config)``.

    Args:
        launcher: A ``Launcher`` class (or any factory of one from a ``RunConfig``).
        config: The run's settings; ``num_proc`` resolved.
        fn: What every rank runs (pickled with cloudpickle).
        args: Its positional arguments.
        kwargs: Its keyword arguments.

    Returns:
        ``fn``'s return values, index = rank.

    Raises:
        ConfigError: Something cannot be pickled.
        WorkerFailedError: A rank failed; the others were stopped.
    """
    payload = worker.pickle_job(fn, args, kwargs)
    with launcher(config) as job:
        return [cloudpickle.loads(result) for result in job.run(payload)]
