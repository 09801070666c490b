"""Backends: Horovod's ``Backend`` API for the Estimators, a thin adapter over a ``Launcher``.

The Estimators start their ranks through ``LauncherBackend``: a ``Launcher`` class (the one
seam for starting ranks, ``runner.launcher``) and the ``RunConfig`` it is built from.
``SparkBackend`` is that over Spark barrier tasks (``SparkJob``), as Horovod code passes it
(``backend=SparkBackend(num_proc=2)``). A custom ``Backend`` can still run the training
function somewhere else, as in Horovod, by implementing ``run`` and ``num_processes``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from hvd_spark.errors import ConfigError
from hvd_spark.runner.launcher import Launcher, run_function
from hvd_spark.runner.run_config import RunConfig

_POLL_S = 1.0


class Backend:
    """Runs a training function on every rank; subclass it for another launcher.

    ``check``, ``with_options`` and ``for_retry`` are the Estimators' questions; a
    custom backend may leave them as they are (nothing to check, nothing to change).
    """

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

    def check(self) -> None:
        """Fail before any data is written when the ranks cannot start (default: no check).

        Raises:
            ConfigError: Too few task slots, or another reason, saying what to change.
        """

    def with_options(self, **options: Any) -> Backend:
        """A backend with ``hvd_spark.run``'s ``options`` filled in where this one left
        them unset (the Estimators' ``verbose``, ``use_gpu``, progress and output hooks);
        a custom backend is returned as it is."""
        return self

    def for_retry(self, wanted: int, wait_s: float) -> Backend:
        """The backend to run again with after a lost rank (default: this one)."""
        return self


def as_backend(backend: Any) -> Backend:
    """``backend`` as a ``Backend``: itself, or Horovod-style duck typing (any object with
    ``run`` and ``num_processes``) behind an adapter that only runs.

    Raises:
        ConfigError: ``backend`` has no ``run`` or ``num_processes``.
    """
    if isinstance(backend, Backend):
        return backend
    if not (callable(getattr(backend, "run", None))
            and callable(getattr(backend, "num_processes", None))):
        raise ConfigError(f"backend must be a Backend (run and num_processes methods), "
                          f"got {type(backend).__name__}")
    return _Adapted(backend)


class _Adapted(Backend):
    """A duck-typed backend: ``run`` and ``num_processes`` are its own, nothing else."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None,
            env: dict[str, str] | None = None) -> list:
        return self.backend.run(fn, args=args, kwargs=kwargs, env=env)

    def num_processes(self) -> int:
        return self.backend.num_processes()


class LauncherBackend(Backend):
    """A ``Backend`` whose every ``run`` is one job of ``launcher`` built from ``config``.

    Args:
        launcher: The ``Launcher`` class that starts the ranks.
        config: The run's settings; a missing ``num_proc`` is resolved by the launcher
            (``Launcher.prepare``) when first needed.
    """

    def __init__(self, launcher: type[Launcher], config: RunConfig) -> None:
        self.launcher = launcher
        self.config = config

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None,
            env: dict[str, str] | None = None) -> list:
        config = self._with_env(env)
        return run_function(self.launcher, self.launcher.prepare(config), fn, args, kwargs)

    def _with_env(self, env: dict[str, str] | None) -> RunConfig:
        """The resolved config, ``env`` added to the ranks' variables."""
        config = self._resolved()
        return dataclasses.replace(config, env={**config.env, **env}) if env else config

    def _resolved(self) -> RunConfig:
        # Only num_proc is kept: what else prepare resolves (use_gpu) stays the caller's.
        if self.config.num_proc is None:
            num_proc = self.launcher.prepare(self.config).num_proc
            assert num_proc is not None
            self.config = self.config.with_num_proc(num_proc)
        return self.config

    def num_processes(self) -> int:
        num_proc = self._resolved().num_proc
        assert num_proc is not None
        return num_proc

    def check(self) -> None:
        self.launcher.prepare(self._resolved())

    def with_options(self, **options: Any) -> LauncherBackend:
        unset = {k: v for k, v in options.items()
                 if v is not None and getattr(self.config, k) is None}
        return self._copy(dataclasses.replace(self.config, **unset))

    def with_num_proc(self, num_proc: int) -> LauncherBackend:
        """A copy that runs ``num_proc`` ranks (a retry with the slots that remain)."""
        return self._copy(self.config.with_num_proc(num_proc))

    def available_slots(self) -> int | None:
        """Ranks the launcher could start now (None: no bound it knows of)."""
        return self.launcher.capacity(self.config)

    def for_retry(self, wanted: int, wait_s: float) -> LauncherBackend:
        """This backend once the launcher can start ``wanted`` ranks again, or one of the
        ranks it can start when ``wait_s`` passes (at least one, else the loss is final)."""
        deadline = time.monotonic() + wait_s
        slots = self.available_slots()
        while slots is not None and slots < wanted and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            slots = self.available_slots()
        if slots is None or slots < 1:
            return self  # nothing to shrink to: the retry's own check will say so
        return self.with_num_proc(min(slots, wanted))

    def _copy(self, config: RunConfig) -> LauncherBackend:
        copy = type(self).__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.config = config
        return copy


class SparkBackend(LauncherBackend):
    """Runs training with ``hvd_spark.run`` on Spark barrier tasks (Horovod's signature).

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

    Raises:
        ConfigError: A bad or unknown keyword (``RunConfig.from_kwargs`` checks them).
    """

    def __init__(self, num_proc: int | None = None, env: dict[str, str] | None = None,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None,
                 prefix_output_with_timestamp: bool = False, verbose: int = 1,
                 start_timeout: float | None = None, use_gpu: bool | None = None,
                 **run_kwargs: Any) -> None:
        from hvd_spark.runner.spark.spark_launcher import SparkJob

        config = RunConfig.from_kwargs(
            where="SparkBackend", num_proc=num_proc, env=env, stdout=stdout, stderr=stderr,
            prefix_output_with_timestamp=prefix_output_with_timestamp, verbose=verbose,
            start_timeout=start_timeout, use_gpu=use_gpu, **run_kwargs)
        super().__init__(SparkJob, config)

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None,
            env: dict[str, str] | None = None, df: Any = None) -> list:
        """As ``Backend.run``; ``df``: a DataFrame whose partitions the ranks' tasks hand
        to them (``hvd_spark.run``'s ``df``: the Estimators' fit without a Store)."""
        if df is None:
            return super().run(fn, args, kwargs, env)
        from hvd_spark.runner.api import run_with_report

        return run_with_report(fn, args, kwargs, self._with_env(env), df).results
