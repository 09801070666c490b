"""get_available_devices() inside the ranks of hvd_spark.run on a real local[2] session."""

from __future__ import annotations

import io

import pyspark  # noqa: F401 - CI installs it: never a skip

import hvd_spark


def _devices_and_variable():
    import os

    from hvd_spark.task import get_available_devices

    return get_available_devices(), os.environ.get("HVD_SPARK_TASK_GPUS")


def test_ranks_of_a_cpu_session_have_no_devices(spark):
    results = hvd_spark.run(_devices_and_variable, num_proc=2, stdout=io.StringIO())
    # The task said "no GPUs" explicitly (""), rather than leaving the variable unset.
    assert results == [([], ""), ([], "")]
