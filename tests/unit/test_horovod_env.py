"""HOROVOD_* settings: honoured ones pass silently, the others are named in one warning."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from hvd_spark import _env
from hvd_spark.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in list(os.environ):
        if var.startswith(("HVD_SPARK_", "HOROVOD_")):
            monkeypatch.delenv(var)
    monkeypatch.setattr(_env, "_warned", False)
    logger = logging.getLogger("hvd_spark")
    level = logger.level
    yield
    logger.setLevel(level)


def test_honoured_launcher_and_build_variables_are_not_reported():
    environ = {
        "HOROVOD_FUSION_THRESHOLD": "1", "HOROVOD_CYCLE_TIME": "1", "HOROVOD_TIMELINE": "DYNAMIC",
        "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0", "HOROVOD_STALL_CHECK_DISABLE": "1",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "30", "HOROVOD_START_TIMEOUT": "30",
        "HOROVOD_SPARK_START_TIMEOUT": "30", "HOROVOD_LOG_LEVEL": "info",
        "HOROVOD_GLOO_IFACE": "lo", "HOROVOD_DYNAMIC_PROCESS_SETS": "1",
        "HOROVOD_RANK": "0", "HOROVOD_SIZE": "1", "HOROVOD_HOSTNAME": "h",
        "HOROVOD_SECRET_KEY": "x", "HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_WITH_PYTORCH": "1",
        "HOROVOD_WITHOUT_MPI": "1", "HOROVOD_NCCL_HOME": "/usr",
        # Flags asking for what hvd_spark does anyway, and the one controller it has.
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_HIERARCHICAL_ALLGATHER": "0",
        "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "/tmp/a.csv",
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "3", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "10",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "20",
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "GLOO",
        "HOROVOD_ELASTIC": "1", "HOROVOD_ELASTIC_TIMEOUT": "60",
        "PATH": "/bin",
    }
    assert _env.unsupported_horovod_vars(environ) == {}


def test_settings_that_cannot_be_honoured_are_reported_with_why():
    environ = {
        "HOROVOD_HIERARCHICAL_ALLGATHER": "1",
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.8", "HOROVOD_CPU_OPERATIONS": "ccl",
        "HOROVOD_THREAD_AFFINITY": "0,1",
        "HOROVOD_FUSION_THRESHOL": "1",  # a typo
    }
    found = _env.unsupported_horovod_vars(environ)
    assert sorted(found) == sorted(environ)
    assert "hierarchical" in found["HOROVOD_HIERARCHICAL_ALLGATHER"]
    assert "Bayesian" in found["HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"]
    assert "typo" in found["HOROVOD_FUSION_THRESHOL"]


@pytest.mark.parametrize("capacity", ["0", "1024"])
def test_cache_capacity_names_the_mpi_cache_and_its_real_size(capacity):
    from hvd_spark.collectives.mpi import response_cache

    why = _env.unsupported_horovod_vars({"HOROVOD_CACHE_CAPACITY": capacity})[
        "HOROVOD_CACHE_CAPACITY"]
    # The MPI backend has a response cache: the warning says so, with the size it really has.
    assert "MPI backend's cache is always on" in why
    assert f"up to {response_cache.CAPACITY} kinds" in why


def test_one_warning_names_them_once_per_process(monkeypatch, caplog):
    monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLGATHER", "1")
    monkeypatch.setenv("HOROVOD_TORUS_ALLREDUCE", "1")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1024")
    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        first = _env.warn_unsupported_horovod_vars()
        second = _env.warn_unsupported_horovod_vars()
    assert sorted(first) == ["HOROVOD_HIERARCHICAL_ALLGATHER", "HOROVOD_TORUS_ALLREDUCE"]
    assert second == first
    records = [r for r in caplog.records if r.name == "hvd_spark"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "HOROVOD_HIERARCHICAL_ALLGATHER='1'" in message and "HOROVOD_TORUS_ALLREDUCE" in message
    assert "HOROVOD_FUSION_THRESHOLD" not in message


def test_nothing_to_warn_logs_nothing(monkeypatch, caplog):
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")  # what Horovod's test_torch.py sets
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    with caplog.at_level(logging.WARNING, logger="hvd_spark"):
        assert _env.warn_unsupported_horovod_vars() == {}
    assert not caplog.records


def test_warning_reaches_stderr_of_a_real_process():
    code = ("import logging; logging.basicConfig()\n"
            "from hvd_spark import _env\n"
            "_env.warn_unsupported_horovod_vars(); _env.warn_unsupported_horovod_vars()\n")
    env = {**os.environ, "HOROVOD_TORUS_ALLREDUCE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "HOROVOD_TORUS_ALLREDUCE" in ln]
    assert len(lines) == 1 and lines[0].startswith("WARNING:hvd_spark:")


@pytest.mark.parametrize("value,level", [
    ("TRACE", 5), ("debug", logging.DEBUG), ("Info", logging.INFO),
    ("WARNING", logging.WARNING), ("error", logging.ERROR), ("FATAL", logging.CRITICAL),
])
def test_horovod_log_level_sets_the_package_logger(monkeypatch, value, level):
    monkeypatch.setenv("HOROVOD_LOG_LEVEL", value)
    assert _env.apply_log_level() == level
    assert logging.getLogger("hvd_spark").level == level
    assert logging.getLogger("hvd_spark.collectives.coordinator").getEffectiveLevel() == level


def test_own_log_level_wins_and_unset_leaves_it_alone(monkeypatch):
    logger = logging.getLogger("hvd_spark")
    logger.setLevel(logging.ERROR)
    assert _env.apply_log_level() is None and logger.level == logging.ERROR
    monkeypatch.setenv("HOROVOD_LOG_LEVEL", "debug")
    monkeypatch.setenv("HVD_SPARK_LOG_LEVEL", "warning")
    assert _env.apply_log_level() == logging.WARNING


def test_bad_log_level_is_named(monkeypatch):
    monkeypatch.setenv("HOROVOD_LOG_LEVEL", "loud")
    with pytest.raises(ConfigError, match="HOROVOD_LOG_LEVEL='loud'.*TRACE, DEBUG"):
        _env.apply_log_level()
