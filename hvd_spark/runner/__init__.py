"""Launchers: ``run_local`` / ``hvdrun`` (local processes) and ``run`` (Spark barrier tasks)."""

from hvd_spark.runner.local_launcher import run_local

__all__ = ["run_local"]
