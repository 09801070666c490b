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


# ---------------------------------------------------------------------- test hygiene
# Fails a test that leaves behind what it created: hvd_spark threads, HVD_SPARK_*/
# HOROVOD_* variables, or shared-memory segments. Only what appeared during the test
# counts, and threads get a grace period to finish (engines say goodbye, pumps drain).

_HYGIENE_GRACE_S = 5.0
_ENV_PREFIXES = ("HVD_SPARK_", "HOROVOD_")
# Threads that legitimately outlive a test: the Spark job thread of a module-scoped
# session's last run ends with the job, and a store connection ends when its client does.
_THREADS_ALLOWED = ("hvd-spark-job", "hvd-store-conn", "hvd-out-", "hvd-log")


def _hvd_threads() -> dict[int, str]:
    import threading

    return {t.ident: t.name for t in threading.enumerate()
            if t.name.startswith("hvd-") and not t.name.startswith(_THREADS_ALLOWED)}


def _hvd_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}


def _shm_segments() -> set[str]:
    import glob

    return set(glob.glob("/dev/shm/hvd_spark_*"))


@pytest.fixture(autouse=True)
def _hygiene():
    """Fail a test that leaks hvd threads, environment changes or /dev/shm files."""
    import time

    threads, env, segments = _hvd_threads(), _hvd_env(), _shm_segments()
    yield
    deadline = time.monotonic() + _HYGIENE_GRACE_S
    while True:
        leaked = {i: n for i, n in _hvd_threads().items() if i not in threads}
        new_segments = _shm_segments() - segments
        if (not leaked and not new_segments) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    changed = {k for k in set(env) | set(_hvd_env()) if env.get(k) != os.environ.get(k)}
    problems = []
    if leaked:
        problems.append(f"threads still running: {sorted(leaked.values())}")
    if changed:
        problems.append(f"environment variables changed: {sorted(changed)} "
                        "(use monkeypatch.setenv)")
    if new_segments:
        problems.append(f"shared-memory files left: {sorted(new_segments)}")
    if problems:
        pytest.fail("test left state behind: " + "; ".join(problems), pytrace=False)
