"""Launchers: ``run_local`` / ``hvdrun`` (local processes) and ``run`` (Spark barrier tasks).

Imports are lazy: ``python -m hvd_spark.runner.worker`` must not import the launchers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Backend", "SparkBackend", "run", "run_local"]


def __getattr__(name: str) -> Any:
    if name == "run_local":
        from hvd_spark.runner.api import run_local

        return run_local
    if name == "run":
        from hvd_spark.runner.api import run

        return run
    if name in ("Backend", "SparkBackend"):
        from hvd_spark.runner import backend

        return getattr(backend, name)
    raise AttributeError(f"module 'hvd_spark.runner' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names too, so that dir() and star-import style copies see them.
    return sorted({*globals(), *__all__})
