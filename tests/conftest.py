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
# No EC2 metadata lookups from the AWS SDK (pyarrow's S3): a connection it keeps open.
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


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


# ---------------------------------------------------------------------- test tiers
# `make test` runs -m "not slow and not multihost and not gpu": unit and contract tests
# plus one end-to-end smoke per feature (marked `smoke` where it is written).
_TIER_BY_FOLDER = {"multihost": "multihost", "gpu": "gpu"}


def pytest_collection_modifyitems(config, items) -> None:
    """Mark tests by folder: multihost/ and gpu/ by name, integration/ slow unless smoke."""
    root = config.rootpath / "tests"
    for item in items:
        try:
            folder = item.path.relative_to(root).parts[0]
        except ValueError:  # a test outside tests/ (e.g. a doctest run by hand)
            continue
        if folder in _TIER_BY_FOLDER:
            item.add_marker(_TIER_BY_FOLDER[folder])
        elif folder == "integration" and item.get_closest_marker("smoke") is None:
            item.add_marker("slow")


@pytest.fixture(scope="module")
def spark():
    """A local[2] SparkSession shared by the tests of one module."""
    return _session("local[2]")


@pytest.fixture(scope="module")
def spark_cluster():
    """A local-cluster[2,1,1024] SparkSession: two executor JVMs, one core each."""
    return _session("local-cluster[2,1,1024]")


@pytest.fixture
def mlflow_client(tmp_path, monkeypatch):
    """An MlflowClient on a fresh sqlite store; the process's tracking URI restored after."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)  # the store's default artifact root is ./mlruns
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # set_tracking_uri writes it: undone after
    mlflow.set_tracking_uri(uri)
    yield mlflow.MlflowClient(uri)
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(None)


# ---------------------------------------------------------------------- test hygiene
# Fails a test that leaves behind what it created (tests/hygiene.py): hvd_spark threads,
# HVD_SPARK_*/HOROVOD_* variables, shared-memory segments, child processes or open file
# descriptors. Only what appeared during the test counts, and it gets a grace period to
# end on its own (engines say goodbye, pumps drain, children are reaped).

_HYGIENE_GRACE_S = 5.0


@pytest.fixture(autouse=True)
def _hygiene():
    """Fail a test that leaks threads, environment changes, /dev/shm files, children or fds."""
    import gc
    import time

    from tests.hygiene import State

    before = State.now()
    yield
    deadline = time.monotonic() + _HYGIENE_GRACE_S
    collected = False
    while True:
        problems = State.now(known=before.children).leaked_since(before)
        if not problems or time.monotonic() > deadline:
            break
        if not collected:
            # A socket held only by a reference cycle (a finished thread's frame, a
            # traceback) closes when the cycle is collected: a leak is what outlives that.
            gc.collect()
            collected = True
        time.sleep(0.1)
    if problems:
        pytest.fail("test left state behind: " + "; ".join(problems), pytrace=False)
