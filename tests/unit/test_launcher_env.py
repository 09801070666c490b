"""The variables launchers give each rank: ours, Horovod's and torch's names agree."""

from __future__ import annotations

import socket

from hvd_spark import _env
from hvd_spark.runner.local.local_launcher import rank_env
from hvd_spark.runner.rendezvous import TaskSlot, assign_ranks
from hvd_spark.runner.spark.spark_task import TaskSpec, child_env


def test_rank_variables_under_every_name():
    env = _env.rank_variables(5, 8, 1, 2, 2, 4, "node3")
    assert env == {
        "HVD_SPARK_RANK": "5", "HOROVOD_RANK": "5", "RANK": "5",
        "HVD_SPARK_SIZE": "8", "HOROVOD_SIZE": "8", "WORLD_SIZE": "8",
        "HVD_SPARK_LOCAL_RANK": "1", "HOROVOD_LOCAL_RANK": "1", "LOCAL_RANK": "1",
        "HVD_SPARK_LOCAL_SIZE": "2", "HOROVOD_LOCAL_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "HVD_SPARK_CROSS_RANK": "2", "HOROVOD_CROSS_RANK": "2",
        "HVD_SPARK_CROSS_SIZE": "4", "HOROVOD_CROSS_SIZE": "4",
        "HVD_SPARK_HOSTNAME": "node3", "HOROVOD_HOSTNAME": "node3",
    }


def test_local_rank_env():
    env = rank_env(1, 3, 4567, b"s" * 32)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "1", "3", "1", "3")
    assert (env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"]) == ("0", "1")
    assert env["HOROVOD_HOSTNAME"] == socket.gethostname()
    assert env[_env.RENDEZVOUS_ADDR] == "127.0.0.1:4567"


def test_spark_child_env_on_two_hosts():
    spec = TaskSpec(driver_addr="10.0.0.1:5000", secret=b"k" * 32, start_timeout_s=30.0,
                    heartbeat_s=10.0, env={"RANK": "99"}, use_gpu=False, run_id="run1")
    infos = assign_ranks([TaskSlot(0, "a"), TaskSlot(1, "b"), TaskSlot(2, "a")])
    env = child_env({}, spec, infos[2], None)  # partition 2 is rank 1: host a's second rank
    assert (env["HOROVOD_RANK"], env["RANK"], env["HOROVOD_SIZE"], env["WORLD_SIZE"]) == (
        "1", "1", "3", "3")
    assert (env["HOROVOD_LOCAL_RANK"], env["LOCAL_RANK"], env["HOROVOD_LOCAL_SIZE"],
            env["LOCAL_WORLD_SIZE"]) == ("1", "1", "2", "2")
    assert (env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"]) == ("0", "1")
    assert env["HOROVOD_HOSTNAME"] == env["HVD_SPARK_HOSTNAME"] == "a"
