"""hvd_spark.task.get_available_devices (Horovod's horovod.spark.task) and how the Spark
task hands its GPU addresses to the rank process."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

import hvd_spark
from hvd_spark import _env
from hvd_spark.runner.rendezvous import TaskSlot, assign_ranks
from hvd_spark.runner.spark.spark_task import TaskSpec, child_env
from hvd_spark.runner.spark.task_process import task_gpu_addresses
from hvd_spark.task import device_index, get_available_devices


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(_env.TASK_GPUS, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return monkeypatch


def test_the_spark_task_addresses_win(clean_env):
    clean_env.setenv(_env.TASK_GPUS, "2,3")
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert get_available_devices() == ["2", "3"]


def test_a_spark_task_without_gpus_has_none_whatever_cuda_says(clean_env):
    clean_env.setenv(_env.TASK_GPUS, "")
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert get_available_devices() == []


def test_outside_spark_cuda_visible_devices_is_the_list(clean_env):
    clean_env.setenv("CUDA_VISIBLE_DEVICES", " 1, 0 ,")
    assert get_available_devices() == ["1", "0"]
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "")
    assert get_available_devices() == []
    # As CUDA reads it: a negative index hides itself and every later one.
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert get_available_devices() == []
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "3,-1,2")
    assert get_available_devices() == ["3"]


def test_nothing_set_means_no_devices(clean_env):
    assert get_available_devices() == []


def test_the_ranks_own_device_index(clean_env):
    clean_env.delenv(_env.GPU_INDEX, raising=False)
    assert device_index() is None  # hvdrun, no GPU, use_gpu=False: local_rank is the rule
    clean_env.setenv(_env.GPU_INDEX, "2")
    assert device_index() == 2
    clean_env.setenv(_env.GPU_INDEX, "")
    assert device_index() is None


def test_the_package_exports_it_lazily():
    assert hvd_spark.get_available_devices is get_available_devices
    assert {"get_available_devices", "run", "run_elastic", "SparkBackend"} <= set(dir(hvd_spark))


def test_the_module_imports_no_spark():
    code = ("import sys, hvd_spark.task; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('pyspark', 'torch', 'tensorflow', 'keras')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"


def test_the_task_reads_its_gpu_resource():
    gpu = types.SimpleNamespace(addresses=["2", 3])
    assert task_gpu_addresses(types.SimpleNamespace(resources=lambda: {"gpu": gpu})) == ["2", "3"]
    assert task_gpu_addresses(types.SimpleNamespace(resources=lambda: {})) == []


def test_the_rank_environment_carries_the_task_gpus():
    spec = TaskSpec(driver_addr="10.0.0.1:5000", secret=b"k" * 32, start_timeout_s=30.0,
                    heartbeat_s=10.0, env={}, use_gpu=False, run_id="run1")
    info = assign_ranks([TaskSlot(0, "a")])[0]
    env = child_env({"CUDA_VISIBLE_DEVICES": "0,1"}, spec, info, None, ["1"])
    assert env[_env.TASK_GPUS] == "1" and env["CUDA_VISIBLE_DEVICES"] == "0,1"
    # No GPUs from Spark is said explicitly, so the rank does not fall back to CUDA's list.
    assert child_env({}, spec, info, None, [])[_env.TASK_GPUS] == ""
    assert _env.TASK_GPUS not in child_env({}, spec, info, None)
