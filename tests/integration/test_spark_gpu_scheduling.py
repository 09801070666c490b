"""Spark's GPU scheduling reaches the ranks: get_available_devices() and CUDA_VISIBLE_DEVICES.

A local-cluster session (one worker, two cores) whose worker "discovers" two GPUs through a
script, and one GPU per task: Spark hands each barrier task its own address. No GPU is
touched, so this runs on any machine. Local mode cannot do it: its single executor has
no resources, so GPU tasks never get scheduled.
"""

from __future__ import annotations

import io
import stat

import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest

import hvd_spark

_DISCOVERY = "#!/bin/sh\necho '{\"name\": \"gpu\", \"addresses\": [\"0\", \"1\"]}'\n"


@pytest.fixture(scope="module")
def gpu_spark(tmp_path_factory):
    """A local-cluster[1,2,1024] session scheduling two fake GPUs, one per task."""
    from pyspark.sql import SparkSession

    script = tmp_path_factory.mktemp("gpu") / "discover_gpus.sh"
    script.write_text(_DISCOVERY)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    active = SparkSession.getActiveSession()
    if active is not None:  # its configuration cannot change: start one of our own
        active.stop()
    session = (
        SparkSession.builder.master("local-cluster[1,2,1024]")
        .appName("hvd_spark-tests-gpu-scheduling")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "1g")
        .config("spark.executor.memory", "1g")
        .config("spark.worker.resource.gpu.amount", "2")
        .config("spark.worker.resource.gpu.discoveryScript", str(script))
        .config("spark.executor.resource.gpu.amount", "2")
        .config("spark.executor.resource.gpu.discoveryScript", str(script))
        .config("spark.task.resource.gpu.amount", "1")
        .getOrCreate()
    )
    yield session
    session.stop()  # the next module's fixture starts a plain session


def test_each_rank_gets_its_tasks_own_gpu(gpu_spark):
    # Nested, so cloudpickle ships it by value: the executors cannot import `tests`.
    def devices_and_cuda():
        import os

        from hvd_spark.task import get_available_devices

        return get_available_devices(), os.environ.get("CUDA_VISIBLE_DEVICES")

    results = hvd_spark.run(devices_and_cuda, num_proc=2, stdout=io.StringIO())
    devices = [d for d, _ in results]
    assert all(len(d) == 1 for d in devices), results
    assert sorted(d[0] for d in devices) == ["0", "1"], results
    # use_gpu defaults to on under GPU scheduling: CUDA sees exactly the task's GPU.
    assert [cuda for _, cuda in results] == [d[0] for d in devices]
