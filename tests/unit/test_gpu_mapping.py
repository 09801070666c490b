"""How hvd_spark.run maps Spark's GPU addresses to each rank's CUDA devices: the host order,
the driver's answer at registration, and the rank's environment (run_elastic's too)."""

from __future__ import annotations

import io
import threading

from hvd_spark import _env
from hvd_spark.collectives.tcp import wire
from hvd_spark.collectives.tcp.store import StoreClient
from hvd_spark.runner.elastic.elastic_task import ElasticTaskSpec, worker_env
from hvd_spark.runner.gpu_mapping import host_gpu_order, index_in_visible, place_gpus
from hvd_spark.runner.output import OutputForwarder
from hvd_spark.runner.rendezvous import TaskSlot, assign_ranks
from hvd_spark.runner.spark.driver_service import REGISTER, DriverService
from hvd_spark.runner.spark.spark_task import TaskSpec, child_env, rank_gpus


def _placed(tasks: list[tuple[str, list[str]]]):
    """Partition -> RankInfo for tasks given as (host, Spark GPU addresses) by partition."""
    slots = [TaskSlot(p, host) for p, (host, _) in enumerate(tasks)]
    return place_gpus(assign_ranks(slots), {p: gpus for p, (_, gpus) in enumerate(tasks)})


def test_one_gpu_per_task_puts_each_ranks_gpu_at_its_local_rank():
    # Spark's addresses in any order; partitions interleave the hosts.
    infos = _placed([("a", ["3"]), ("b", ["0"]), ("a", ["1"]), ("b", ["1"])])
    for info in infos.values():
        assert info.host_gpus[info.local_rank] == info.host_gpus[info.gpu_index]
        assert info.gpu_index == info.local_rank
    assert infos[0].host_gpus == infos[2].host_gpus == ("3", "1")
    assert infos[1].host_gpus == infos[3].host_gpus == ("0", "1")


def test_shared_gpus_appear_once_and_ranks_get_the_index_of_theirs():
    # spark.task.resource.gpu.amount=0.5: two ranks per address, as Spark assigned them.
    infos = _placed([("h", ["0"]), ("h", ["1"]), ("h", ["0"]), ("h", ["1"])])
    assert {i.host_gpus for i in infos.values()} == {("0", "1")}  # CUDA refuses duplicates
    assert [infos[p].gpu_index for p in range(4)] == [0, 1, 0, 1]
    # Horovod's set_device(local_rank) cannot work here: local ranks 2 and 3 have no device.
    assert [infos[p].local_rank for p in range(4)] == [0, 1, 2, 3]


def test_several_gpus_per_task_first_ones_first():
    assert host_gpu_order([["0", "1"], ["2", "3"]]) == ["0", "2", "1", "3"]
    infos = _placed([("h", ["0", "1"]), ("h", ["2", "3"])])
    assert infos[0].host_gpus == ("0", "2", "1", "3")
    assert (infos[0].gpu_index, infos[1].gpu_index) == (0, 1)


def test_no_gpus_means_no_placement():
    infos = _placed([("h", []), ("h", [])])
    assert all(i.host_gpus == () and i.gpu_index is None for i in infos.values())
    assert host_gpu_order([]) == []


def test_the_rank_environment_under_use_gpu():
    info = _placed([("h", ["5"]), ("h", ["2"])])[1]
    spec = TaskSpec(driver_addr="10.0.0.1:5000", secret=b"k" * 32, start_timeout_s=30.0,
                    heartbeat_s=10.0, env={_env.GPU_INDEX: "7"}, use_gpu=True, run_id="run1")
    env = child_env({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}, spec, info, rank_gpus(spec, info),
                    ["2"])
    assert env["CUDA_VISIBLE_DEVICES"] == "5,2" and env[_env.GPU_INDEX] == "1"
    assert env[_env.TASK_GPUS] == "2" and env[_env.LOCAL_RANK] == "1"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # Spark's addresses are nvidia-smi's
    # The executor's own device order wins; without use_gpu nothing about devices is set.
    kept = child_env({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, spec, info, ["5", "2"], ["2"])
    assert kept["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"
    plain = TaskSpec(driver_addr="10.0.0.1:5000", secret=b"k" * 32, start_timeout_s=30.0,
                     heartbeat_s=10.0, env={_env.GPU_INDEX: "7"}, use_gpu=False, run_id="run1")
    env = child_env({"CUDA_VISIBLE_DEVICES": "0,1"}, plain, info, rank_gpus(plain, info), ["2"])
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and _env.GPU_INDEX not in env


def test_a_rank_without_a_gpu_sees_none_of_its_hosts():
    infos = _placed([("h", ["0"]), ("h", [])])
    spec = TaskSpec(driver_addr="10.0.0.1:5000", secret=b"k" * 32, start_timeout_s=30.0,
                    heartbeat_s=10.0, env={}, use_gpu=True, run_id="run1")
    assert rank_gpus(spec, infos[0]) == ["0"] and rank_gpus(spec, infos[1]) == []
    env = child_env({}, spec, infos[1], rank_gpus(spec, infos[1]), [])
    assert env["CUDA_VISIBLE_DEVICES"] == "" and _env.GPU_INDEX not in env


def test_the_driver_answers_each_task_with_its_hosts_order():
    secret = b"s" * 32
    output = OutputForwarder(io.StringIO(), io.StringIO())
    tasks = {0: ("a", ("1",)), 1: ("b", ("0",)), 2: ("a", ("0",)), 3: ("b", ("1",))}
    with DriverService(4, secret, "127.0.0.1", "127.0.0.1", output) as service:
        replies = {}

        def register(partition: int) -> None:
            host, gpus = tasks[partition]
            client = StoreClient(wire.parse_addr(service.addr), secret, 5.0)
            try:
                replies[partition] = client.call(REGISTER, partition, host, 5.0, gpus,
                                                 timeout=5.0)
            finally:
                client.close()

        threads = [threading.Thread(target=register, args=(p,)) for p in (3, 1, 0, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert {p: (i.host_gpus, i.gpu_index) for p, i in replies.items()} == {
        0: (("1", "0"), 0), 2: (("1", "0"), 1), 1: (("0", "1"), 0), 3: (("0", "1"), 1)}


def test_elastic_workers_keep_the_executors_devices_and_learn_their_own():
    spec = ElasticTaskSpec(driver_addr="10.0.0.1:5000", secret=b"k" * 32, start_timeout_s=30.0,
                           elastic_timeout_s=60.0, heartbeat_s=10.0, env={}, run_id="run1")
    env = worker_env({"CUDA_VISIBLE_DEVICES": "4,6", _env.GPU_INDEX: "9"}, spec, "0.0", "h",
                     ["6"])
    assert env["CUDA_VISIBLE_DEVICES"] == "4,6" and env[_env.TASK_GPUS] == "6"
    assert env[_env.GPU_INDEX] == "1"
    env = worker_env({}, spec, "0.0", "h", ["3"])  # no list: CUDA numbers the machine's GPUs
    assert env[_env.GPU_INDEX] == "3"
    env = worker_env({}, spec, "0.0", "h", [])
    assert env[_env.TASK_GPUS] == "" and _env.GPU_INDEX not in env
    assert _env.TASK_GPUS not in worker_env({}, spec, "0.0", "h")
    assert index_in_visible("2", "0,1") is None and index_in_visible("gpu-a", None) is None
