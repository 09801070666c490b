"""get_available_devices() inside the ranks of hvd_spark.run on a real local[2] session, and
use_gpu=True refused there before anything starts."""

from __future__ import annotations

import io

import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest

import hvd_spark
from hvd_spark.errors import ConfigError
from hvd_spark.runner.spark import spark_launcher


def _devices_and_variable():
    import os

    from hvd_spark.task import get_available_devices

    return get_available_devices(), os.environ.get("HVD_SPARK_TASK_GPUS")


def test_ranks_of_a_cpu_session_have_no_devices(spark):
    results = hvd_spark.run(_devices_and_variable, num_proc=2, stdout=io.StringIO())
    # The task said "no GPUs" explicitly (""), rather than leaving the variable unset.
    assert results == [([], ""), ([], "")]


def test_use_gpu_on_a_session_without_gpus_fails_before_anything_starts(spark, monkeypatch):
    def no_service(*args, **kwargs):
        raise AssertionError("the driver service started: the check came too late")

    # no service, no barrier stage
    monkeypatch.setattr(spark_launcher, "DriverService", no_service)
    with pytest.raises(ConfigError) as err:
        hvd_spark.run(_devices_and_variable, num_proc=2, use_gpu=True, stdout=io.StringIO())
    text = str(err.value)
    assert text.startswith("hvd_spark.run(use_gpu=True), but this Spark session schedules no "
                           "GPUs to tasks")
    for name in ("spark.executor.resource.gpu.amount", "spark.task.resource.gpu.amount",
                 "spark.executor.resource.gpu.discoveryScript", "use_gpu=False"):
        assert name in text
