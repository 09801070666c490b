"""The contract every launcher keeps: publish the job, start the ranks, watch, stop, collect.

Four launchers implement it: Spark barrier tasks (``spark.spark_launcher.SparkLaunch``),
local processes (``local.local_launcher.LocalJob``), hosts over ssh
(``local.ssh_launcher.SshJob``) and ``mpirun`` (``local.mpi_launcher.MpiJob``). Whatever
starts the ranks, the caller sees the same thing: results in rank order, a failing
rank's traceback naming the rank, and every rank process gone within a deadline once
``stop`` returns. ``tests/contract/test_launcher_contract.py`` checks all of them.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from hvd_spark.errors import WorkerFailedError
from hvd_spark.runner.failures import WorkerFailure


class Launcher(abc.ABC):
    """One job's ranks, started and seen through by one launcher.

    Use it as a context manager (leaving it stops every rank), or call the steps:
    ``publish`` the pickled function, ``start`` the ranks, ``watch`` until they end,
    then ``collect`` their results.

    Attributes:
        num_proc: Number of ranks.
    """

    num_proc: int

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
        """End every rank process now (and within ``Timeouts.stop_grace`` plus a few
        seconds); safe to call more than once."""

    @abc.abstractmethod
    def collect(self) -> list[bytes]:
        """The ranks' pickled results in rank order, after ``watch``.

        Raises:
            WorkerFailedError: A rank failed (root cause first, with its traceback).
        """

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
        self.stop()
