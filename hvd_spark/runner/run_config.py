"""A run's settings, checked once: ``RunConfig``, ``ElasticConfig`` and their ``Timeouts``.

``hvd_spark.run``, ``run_elastic`` and ``hvdrun`` build these from their public keyword
arguments (or options) and hand them down, so a launcher reads one validated object
instead of a dozen loose arguments. Each check names the parameter and how to fix it.
Nothing here imports pyspark or starts anything.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import types
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from hvd_spark import _env
from hvd_spark.collectives.heartbeat import DEFAULT_HEARTBEAT_S
from hvd_spark.config import DEFAULT_START_TIMEOUT_S
from hvd_spark.errors import ConfigError

#: Seconds an elastic ring may take to re-form after a loss (``HVD_SPARK_ELASTIC_TIMEOUT``).
DEFAULT_ELASTIC_TIMEOUT_S = 600.0
#: Seconds between asking a rank to stop and killing it: ``Launcher.stop``, a Spark task
#: reaping its rank, ``remote_rank`` on an ssh host (the one stop grace of every launcher).
DEFAULT_STOP_GRACE_S = 3.0

log = logging.getLogger("hvd_spark.runner")


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Every deadline of one run, in seconds.

    Attributes:
        start_timeout_s: For every rank's task to start and register (not for a started
            rank's imports before ``init()``, as in Horovod).
        elastic_timeout_s: For a broken elastic ring to re-form.
        heartbeat_s: Silence after which a rank counts as lost (0: off).
        collective_timeout_s: What one collective may wait for its peers (``hvdrun
            --timeout``; None: the ranks' own default, ``HVD_SPARK_TIMEOUT``).
        stop_grace_s: Between asking the ranks to stop and killing them.
    """

    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    elastic_timeout_s: float = DEFAULT_ELASTIC_TIMEOUT_S
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    collective_timeout_s: float | None = None
    stop_grace_s: float = DEFAULT_STOP_GRACE_S

    def __post_init__(self) -> None:
        # The messages name the public keywords (start_timeout=, hvdrun --timeout).
        for name in ("start_timeout", "elastic_timeout"):
            value = getattr(self, f"{name}_s")
            if not _is_number(value) or not value > 0:
                raise ConfigError(f"{name} must be positive seconds, got {value}")
        if not _is_number(self.heartbeat_s) or self.heartbeat_s < 0:
            raise ConfigError(f"heartbeat_s must be >= 0 (0: off), got {self.heartbeat_s}")
        if self.collective_timeout_s is not None and not (
                _is_number(self.collective_timeout_s) and self.collective_timeout_s > 0):
            raise ConfigError(
                f"timeout must be positive seconds, got {self.collective_timeout_s}")
        if not _is_number(self.stop_grace_s) or self.stop_grace_s < 0:
            raise ConfigError(f"stop_grace_s must be >= 0 seconds, got {self.stop_grace_s}")

    @classmethod
    def for_run(cls, start_timeout: float | None = None,
                env: Mapping[str, str] | None = None) -> Timeouts:
        """The deadlines of ``hvd_spark.run``: the arguments, else the variables.

        ``start_timeout`` defaults to ``HVD_SPARK_START_TIMEOUT``, else 600 s; the
        heartbeat limit to the run's ``env``, else the driver's, else 10 s.

        Raises:
            ConfigError: A deadline that is not positive, or not a number.
        """
        if start_timeout is None:
            start_timeout = _env.get_float(_env.START_TIMEOUT, DEFAULT_START_TIMEOUT_S)
        return cls(start_timeout_s=_seconds(start_timeout, "start_timeout"),
                   heartbeat_s=heartbeat_limit(env or {}))


def heartbeat_limit(user_env: Mapping[str, str]) -> float:
    """The ranks' heartbeat limit: the run's ``env``, else the driver's, else 10 s."""
    value = user_env.get(_env.HEARTBEAT)
    if value:
        try:
            return float(value)
        except ValueError:
            raise ConfigError(
                f"{_env.HEARTBEAT}={value!r} in env is not a number of seconds") from None
    return _env.get_float(_env.HEARTBEAT, DEFAULT_HEARTBEAT_S)


def horovod_keywords(env: Mapping[str, str] | None, *, extra_mpi_args: str | None = None,
                     nics: Sequence[str] | str | None = None, executable: str | None = None,
                     use_mpi: bool | None = None,
                     use_gloo: bool | None = None) -> dict[str, str] | None:
    """Apply Horovod's launcher keywords that mean something here; log the others once.

    Returns ``env``, with ``HVD_SPARK_IFACE`` added when ``nics`` names an interface.

    Raises:
        ConfigError: Both ``use_mpi`` and ``use_gloo``, or ``nics`` that are not names.
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
        return {**(env or {}), _env.IFACE: names[0]}
    return None if env is None else dict(env)


#: ``hvd_spark.run``'s keywords that only Horovod's callers pass (see ``horovod_keywords``).
HOROVOD_KEYWORDS = ("extra_mpi_args", "nics", "executable", "use_mpi", "use_gloo")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What ``hvd_spark.run`` (and ``hvdrun``) was asked for, checked.

    Attributes:
        num_proc: Number of ranks (None: the cluster's default parallelism, resolved by
            the launcher with ``with_num_proc``).
        env: Variables added to every rank's environment (read-only).
        use_gpu: Show each rank its GPU (None: when Spark schedules GPUs).
        verbose: 0 quiet, 1 the start and end of the run, 2 also timings.
        stdout, stderr: Streams receiving the ranks' output (None: the driver's).
        prefix_output_with_timestamp: Start each forwarded line with the time.
        progress: Receives the ranks' progress events as ``(rank, event)``.
        on_output: Also receives every output line as ``(rank, stream, line)``.
        timeouts: Every deadline of the run.
        ranks_per_task: Ranks each Spark task runs (``TorchDistributor`` with several
            GPUs per task: one rank per GPU); ``num_proc`` must be a multiple of it.
    """

    num_proc: int | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    use_gpu: bool | None = None
    verbose: int = 1
    stdout: IO[str] | None = None
    stderr: IO[str] | None = None
    prefix_output_with_timestamp: bool = False
    progress: Callable[[int, dict[str, Any]], None] | None = None
    on_output: Callable[[int, str, str], None] | None = None
    timeouts: Timeouts = dataclasses.field(default_factory=Timeouts)
    ranks_per_task: int = 1

    def __post_init__(self) -> None:
        env = dict(self.env or {})
        bad = [k for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ConfigError(f"env must map str to str; not so for {bad!r}")
        # Frozen all the way down: a launcher cannot change what another one reads.
        object.__setattr__(self, "env", types.MappingProxyType(env))
        if self.num_proc is not None:
            _check_num_proc(self.num_proc, "num_proc")
        _check_num_proc(self.ranks_per_task, "ranks_per_task")
        if self.num_proc is not None and self.num_proc % self.ranks_per_task:
            raise ConfigError(f"num_proc={self.num_proc} is not a multiple of ranks_per_task="
                              f"{self.ranks_per_task} (each Spark task runs that many ranks)")
        if not isinstance(self.verbose, int):
            raise ConfigError(f"verbose must be 0, 1 or 2, got {self.verbose!r}")

    @classmethod
    def keywords(cls) -> list[str]:
        """The keywords ``from_kwargs`` takes: ``hvd_spark.run``'s options, all of them."""
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "timeouts"]
        return sorted([*fields, "start_timeout", *HOROVOD_KEYWORDS])

    @classmethod
    def from_kwargs(cls, *, start_timeout: float | None = None,
                    env: Mapping[str, str] | None = None, where: str = "hvd_spark.run",
                    **kwargs: Any) -> RunConfig:
        """Build from ``hvd_spark.run``'s keyword arguments: the one place they are checked.

        ``start_timeout`` and the heartbeat limit get their defaults (``Timeouts.for_run``),
        Horovod's launcher keywords are applied (``horovod_keywords``).

        Args:
            start_timeout: Seconds for every rank to start (None: the default).
            env: Variables for every rank.
            where: Who was given the keywords, for the message about an unknown one.
            **kwargs: Any other keyword of ``hvd_spark.run`` (see ``keywords``).

        Raises:
            ConfigError: Naming the bad argument, or listing the known ones.
        """
        unknown = sorted(set(kwargs) - set(cls.keywords()))
        if unknown:
            raise ConfigError(f"{where} got unknown keyword(s) {unknown}; it takes "
                              f"{cls.keywords()}")
        horovod = {k: kwargs.pop(k) for k in HOROVOD_KEYWORDS if k in kwargs}
        env = horovod_keywords(env, **horovod)
        config = cls(env=dict(env or {}), **kwargs)  # env is checked before it is read
        return dataclasses.replace(config, timeouts=Timeouts.for_run(start_timeout, config.env))

    def with_num_proc(self, num_proc: int) -> RunConfig:
        """This configuration with ``num_proc`` resolved (it is checked again)."""
        return dataclasses.replace(self, num_proc=num_proc)


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """Sizes and deadlines of an elastic job.

    Attributes:
        num_proc: Workers the first generation waits for.
        min_np: Fewest workers the job may continue with.
        max_np: Most workers a generation may hold.
        reset_limit: Most re-formations after the first generation (None: no limit).
        timeouts: ``start_timeout_s`` (the first generation waits that long for
            ``num_proc`` workers, then starts with at least ``min_np``),
            ``elastic_timeout_s`` (a broken generation waits that long for its survivors,
            or for new workers when fewer than ``min_np`` are left), ``heartbeat_s``.
    """

    num_proc: int
    min_np: int
    max_np: int
    reset_limit: int | None = None
    timeouts: Timeouts = dataclasses.field(default_factory=Timeouts)

    def __post_init__(self) -> None:
        for name in ("num_proc", "min_np", "max_np"):
            _check_num_proc(getattr(self, name), name)
        if not self.min_np <= self.num_proc <= self.max_np:
            raise ConfigError(
                f"need min_np <= num_proc <= max_np, got min_np={self.min_np}, "
                f"num_proc={self.num_proc}, max_np={self.max_np}")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ConfigError(f"reset_limit must be >= 0 or None, got {self.reset_limit}")

    @classmethod
    def of(cls, num_proc: int, min_np: int, max_np: int,
           start_timeout: float = DEFAULT_START_TIMEOUT_S,
           elastic_timeout: float = DEFAULT_ELASTIC_TIMEOUT_S, reset_limit: int | None = None,
           heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> ElasticConfig:
        """Build from the flat keyword arguments (Horovod's names for the deadlines).

        Raises:
            ConfigError: Naming the bad argument (sizes first).
        """
        sizes = cls(num_proc, min_np, max_np, reset_limit)
        timeouts = Timeouts(start_timeout_s=start_timeout, elastic_timeout_s=elastic_timeout,
                            heartbeat_s=heartbeat_s)
        return dataclasses.replace(sizes, timeouts=timeouts)

    @classmethod
    def from_kwargs(cls, num_proc: int, min_np: int | None = None, max_np: int | None = None,
                    start_timeout: float | None = None, elastic_timeout: float | None = None,
                    reset_limit: int | None = None,
                    env: Mapping[str, str] | None = None) -> ElasticConfig:
        """Build from ``run_elastic``'s keyword arguments, None meaning "not given".

        ``min_np``/``max_np`` default to ``num_proc``; ``start_timeout`` to
        ``HVD_SPARK_START_TIMEOUT``, ``elastic_timeout`` to ``HVD_SPARK_ELASTIC_TIMEOUT``
        (else 600 s each); the heartbeat limit to the job's ``env``, else the driver's. A
        given 0 is an error, never the default.

        Raises:
            ConfigError: Naming the bad argument.
        """
        if start_timeout is None:
            start_timeout = _env.get_float(_env.START_TIMEOUT, DEFAULT_START_TIMEOUT_S)
        if elastic_timeout is None:
            elastic_timeout = _env.get_float(_env.ELASTIC_TIMEOUT, DEFAULT_ELASTIC_TIMEOUT_S)
        return cls.of(num_proc=num_proc,
                      min_np=num_proc if min_np is None else min_np,
                      max_np=num_proc if max_np is None else max_np,
                      start_timeout=_seconds(start_timeout, "start_timeout"),
                      elastic_timeout=_seconds(elastic_timeout, "elastic_timeout"),
                      reset_limit=reset_limit, heartbeat_s=heartbeat_limit(env or {}))

    @property
    def start_timeout_s(self) -> float:
        """Seconds the first generation waits for ``num_proc`` workers."""
        return self.timeouts.start_timeout_s

    @property
    def elastic_timeout_s(self) -> float:
        """Seconds a broken generation waits to re-form."""
        return self.timeouts.elastic_timeout_s

    @property
    def heartbeat_s(self) -> float:
        """Seconds of silence after which a worker is declared lost (0: off)."""
        return self.timeouts.heartbeat_s


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real)


def _seconds(value: object, name: str) -> float:
    if not _is_number(value):
        raise ConfigError(f"{name} must be positive seconds, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _check_num_proc(value: object, name: str) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
