"""``hvd_spark.HorovodRunner``: Databricks' retired ``sparkdl.HorovodRunner``, on our ranks.

A notebook that said ``from sparkdl import HorovodRunner`` changes that line only:
``HorovodRunner(np=2).run(main, **kwargs)`` runs ``main(**kwargs)`` on 2 Spark barrier
tasks (``np < 0``: ``-np`` processes on the driver) and returns the first process's
return value. Inside ``main``, ``import hvd_spark.torch as hvd`` works, and so does
``import horovod.torch as hvd`` once the alias is on (``hvd_spark.compat``), which
HorovodRunner turns on in its ranks.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import IO, Any

from hvd_spark import _env

VERBOSITIES = ("all", "log_callback_only")


class _FirstRankOnly(io.TextIOBase):
    """A stream that passes on the lines of rank 0 (``[0] ...``) and drops the others'."""

    def __init__(self, target: IO[str]) -> None:
        self._target = target

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        kept = [line for line in text.splitlines(keepends=True) if line.startswith("[0]")]
        if kept:
            self._target.write("".join(kept))
            self._target.flush()
        return len(text)


class HorovodRunner:
    """Run a Horovod training function on Spark, as sparkdl's ``HorovodRunner`` did.

    Args:
        np: Number of processes. Positive: that many Spark barrier tasks. Negative:
            ``-np`` processes on the driver (for trying a job out, as in sparkdl).
        driver_log_verbosity: ``"all"`` streams every process's output to the driver;
            ``"log_callback_only"`` only the first process's (where Horovod code's
            ``if hvd.rank() == 0`` logging and Keras' progress callbacks print).

    Raises:
        ValueError: ``np`` is 0 or not an integer, or an unknown verbosity.
    """

    def __init__(self, np: int, driver_log_verbosity: str = "all") -> None:
        if isinstance(np, bool) or not isinstance(np, int) or np == 0:
            raise ValueError(
                f"HorovodRunner(np={np!r}): np must be a non-zero integer: a positive np runs "
                "that many Spark tasks, a negative np runs -np processes on the driver")
        if driver_log_verbosity not in VERBOSITIES:
            raise ValueError(f"driver_log_verbosity must be one of {VERBOSITIES}, got "
                             f"{driver_log_verbosity!r}")
        self.num_processor = np
        self.driver_log_verbosity = driver_log_verbosity

    def run(self, main: Callable, **kwargs: Any) -> Any:
        """Run ``main(**kwargs)`` on every process; return the first process's value.

        Raises:
            WorkerFailedError: A process failed (its traceback included); the others
                were stopped.
        """
        import sys

        # Ranks may `import horovod.torch as hvd`: the opt-in alias, on in these ranks only.
        env = {_env.HOROVOD_ALIAS: "1"}
        out: IO[str] | None = None
        err: IO[str] | None = None
        if self.driver_log_verbosity == "log_callback_only":
            out, err = _FirstRankOnly(sys.stdout), _FirstRankOnly(sys.stderr)
        if self.num_processor < 0:
            from hvd_spark.runner.local.local_launcher import run_local

            results = run_local(main, kwargs=kwargs, num_proc=-self.num_processor, env=env,
                                stdout=out, stderr=err)
        else:
            from hvd_spark.runner.api import run

            results = run(main, kwargs=kwargs, num_proc=self.num_processor, env=env,
                          stdout=out, stderr=err)
        return results[0]
