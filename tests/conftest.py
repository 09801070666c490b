"""Shared fixtures: real local Spark sessions and a clean environment for real processes."""

from __future__ import annotations

import os
import sys

import pytest

# Spark workers must use this interpreter (with hvd_spark installed), on loopback.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _session(master: str):
    """Return a SparkSession on ``master``, stopping one on another master first."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        if active.sparkContext.master == master:
            return active
        active.stop()
    return (
        SparkSession.builder.master(master)
        .appName("hvd_spark-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.driver.memory", "1g")
        .config("spark.executor.memory", "1g")
        .config("spark.python.worker.reuse", "true")
        .getOrCreate()
    )


@pytest.fixture(scope="module")
def spark():
    """A local[2] SparkSession shared by the tests of one module."""
    return _session("local[2]")


@pytest.fixture(scope="module")
def spark_cluster():
    """A local-cluster[2,1,1024] SparkSession: two executor JVMs, one core each."""
    return _session("local-cluster[2,1,1024]")
