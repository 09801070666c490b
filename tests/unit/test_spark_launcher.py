"""Pre-launch checks of the Spark launcher, against a fake SparkContext (no JVM)."""

from __future__ import annotations

import types

import pytest

from hvd_spark.errors import ConfigError
from hvd_spark.runner.spark import spark_launcher, spark_task


class _Conf:
    def __init__(self, values: dict[str, str]) -> None:
        self._values = values

    def get(self, key: str, default: str | None = None) -> str | None:
        return self._values.get(key, default)


def _sc(master: str, parallelism: int = 2, **conf: str):
    values = {k.replace("_", "."): v for k, v in conf.items()}
    return types.SimpleNamespace(master=master, defaultParallelism=parallelism,
                                 getConf=lambda: _Conf(values))


def test_task_slots_follow_the_master_and_task_cpus():
    assert spark_launcher.task_slots(_sc("local[4]", 4)) == 4
    assert spark_launcher.task_slots(_sc("local[4]", 4, spark_task_cpus="2")) == 2
    assert spark_launcher.task_slots(_sc("local-cluster[3, 2, 1024]", 2)) == 6


def test_too_many_ranks_fail_fast_naming_the_limit():
    with pytest.raises(ConfigError, match=r"num_proc=3 but the cluster runs at most 2"):
        spark_launcher.check_cluster(_sc("local[2]", 2), 3)
    spark_launcher.check_cluster(_sc("local[2]", 2), 2)


def test_dynamic_allocation_is_refused_with_what_to_set():
    sc = _sc("spark://m:7077", 8, spark_dynamicAllocation_enabled="true")
    with pytest.raises(ConfigError, match="spark.dynamicAllocation.enabled=false"):
        spark_launcher.check_cluster(sc, 2)


def test_use_gpu_defaults_to_spark_gpu_scheduling():
    assert spark_launcher.resolve_use_gpu(_sc("local[2]"), None) is False
    gpu_sc = _sc("local[2]", spark_task_resource_gpu_amount="1")
    assert spark_launcher.resolve_use_gpu(gpu_sc, None) is True
    with pytest.raises(ConfigError) as err:
        spark_launcher.resolve_use_gpu(_sc("local[2]"), True)
    # What to set, all three, and the way out.
    for name in ("spark.executor.resource.gpu.amount", "spark.executor.resource.gpu."
                 "discoveryScript", "spark.task.resource.gpu.amount", "use_gpu=False"):
        assert name in str(err.value)
    assert spark_launcher.resolve_use_gpu(_sc("local[2]"), False) is False


def test_use_gpu_shows_the_rank_its_hosts_gpus_and_nothing_without():
    info = types.SimpleNamespace(host_gpus=("2", "3"), gpu_index=1)
    spec = spark_task.TaskSpec(driver_addr="h:1", secret=b"k" * 32, start_timeout_s=30.0,
                               heartbeat_s=10.0, env={}, use_gpu=True, run_id="run1")
    assert spark_task.rank_gpus(spec, info) == ["2", "3"]
    off = spark_task.TaskSpec(driver_addr="h:1", secret=b"k" * 32, start_timeout_s=30.0,
                              heartbeat_s=10.0, env={}, use_gpu=False, run_id="run1")
    assert spark_task.rank_gpus(off, info) is None  # the executor's CUDA_VISIBLE_DEVICES


def test_driver_address_is_loopback_locally_and_driver_host_on_a_cluster():
    assert spark_launcher.driver_hosts(_sc("local[2]")) == ("127.0.0.1", "127.0.0.1")
    sc = _sc("yarn", spark_driver_host="10.1.2.3")
    assert spark_launcher.driver_hosts(sc) == ("10.1.2.3", "10.1.2.3")


def test_output_lines_can_start_with_a_timestamp():
    import io
    import re

    from hvd_spark.runner.output import OutputForwarder

    out = io.StringIO()
    OutputForwarder(out, io.StringIO(), timestamps=True).write(3, "stdout", "epoch 1\n")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[3\] epoch 1\n", out.getvalue())


def test_a_task_cut_off_from_the_driver_says_so_before_the_start_timeout(monkeypatch):
    """A real listener that never answers stands for a driver behind a partition."""
    import socket
    import time

    from hvd_spark.errors import RendezvousTimeoutError

    monkeypatch.setattr(spark_task, "CONNECT_TIMEOUT_S", 1.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        addr = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(RendezvousTimeoutError) as info:
            spark_task.connect_to_driver(addr, b"s" * 32, start_timeout=600, host="hostA")
        assert time.monotonic() - started < 30  # the handshake deadline, not the 600 s
    message = str(info.value)
    assert "host hostA cannot reach the hvd_spark driver service at " + addr in message
    assert "spark.driver.host" in message
