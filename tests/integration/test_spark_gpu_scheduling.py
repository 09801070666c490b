"""Spark's GPU scheduling reaches the ranks of hvd_spark.run as Horovod code expects.

Spark schedules GPUs with any discovery script, so these run on a CPU machine: each
worker "discovers" GPUs 0 and 1. Two sessions, one per ``spark.task.resource.gpu.amount``:

- 1: ``local-cluster[2,2,1024]``, two hosts x two GPUs, one GPU per rank;
- 0.5: ``local-cluster[1,4,1024]``, one host, four ranks sharing two GPUs.

The executors' Python is a wrapper naming each executor's host (``HVD_SPARK_HOSTNAME``,
from its work directory): a local cluster's workers share this machine's name, and two
"hosts" that each discover GPUs 0 and 1 are what a real cluster looks like. No GPU is
touched: the ranks run Horovod's ``set_device(hvd.local_rank())`` and the Estimators'
device choice against a fake ``torch.cuda`` over their ``CUDA_VISIBLE_DEVICES``. Local
mode cannot do any of this: its one executor never gets GPU tasks scheduled.
"""

from __future__ import annotations

import collections
import io
import os
import sys

import cloudpickle
import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest

import hvd_spark
from tests import fake_gpus
from tests.fake_gpus import FakeCuda, write_script

# The executors cannot import tests: the probe ships FakeCuda by value.
cloudpickle.register_pickle_by_value(fake_gpus)
# The Python worker runs in its executor's work directory, named by the executor's id.
_PYTHON = '#!/bin/sh\nHVD_SPARK_HOSTNAME="host-$(basename "$PWD")" exec {python} "$@"\n'


def _gpu_session(master: str, amount: str, tmp):
    """A session on ``master`` whose executors discover GPUs 0 and 1, ``amount`` per task."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    discovery = write_script(tmp / "discover_gpus.sh")
    python = write_script(tmp / "python.sh", _PYTHON.format(python=sys.executable))
    active = SparkSession.getActiveSession()
    if active is not None:  # its configuration cannot change: start one of our own
        active.stop()
    # The JVM keeps the configuration it was launched with as system properties, which
    # every later SparkConf reads: launched by this session, it would hand its GPU
    # settings to the next module's plain session (whose tasks then never schedule).
    SparkContext._ensure_initialized()
    previous = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = python  # read once, when the context starts
    try:
        return (
            SparkSession.builder.master(master)
            .appName("hvd_spark-tests-gpu-scheduling")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.memory", "1g")
            .config("spark.executor.memory", "1g")
            .config("spark.python.worker.reuse", "true")
            .config("spark.worker.resource.gpu.amount", "2")
            .config("spark.worker.resource.gpu.discoveryScript", discovery)
            .config("spark.executor.resource.gpu.amount", "2")
            .config("spark.executor.resource.gpu.discoveryScript", discovery)
            .config("spark.task.resource.gpu.amount", amount)
            .getOrCreate()
        )
    finally:
        if previous is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = previous


@pytest.fixture(scope="module")
def whole_gpus(tmp_path_factory):
    """Two hosts x two GPUs, one GPU per task."""
    session = _gpu_session("local-cluster[2,2,1024]", "1", tmp_path_factory.mktemp("gpu1"))
    yield session
    session.stop()  # the next module's fixture starts a plain session


@pytest.fixture(scope="module")
def two_gpu_tasks(tmp_path_factory):
    """Two hosts x two GPUs, both GPUs of a host in its one task."""
    session = _gpu_session("local-cluster[2,2,1024]", "2", tmp_path_factory.mktemp("gpu2"))
    yield session
    session.stop()


@pytest.fixture(scope="module")
def half_gpus(tmp_path_factory):
    """One host, four tasks sharing two GPUs (half a GPU each)."""
    session = _gpu_session("local-cluster[1,4,1024]", "0.5", tmp_path_factory.mktemp("gpu05"))
    yield session
    session.stop()


def _device_probe():
    """A rank function returning what the rank sees, and where Horovod's idiom and the
    Estimators put it. Nested, so cloudpickle ships it by value: the executors cannot
    import ``tests``."""

    def probe() -> dict:
        import os
        import types

        import hvd_spark.collectives as hvd
        from hvd_spark.estimator.keras_worker import place_keras
        from hvd_spark.estimator.torch_worker import training_device
        from hvd_spark.task import device_index, get_available_devices

        visible = [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d]

        hvd.init()
        try:
            cuda = FakeCuda(visible)  # CUDA over the visible devices
            try:
                cuda.set_device(hvd.local_rank())  # Horovod's idiom, verbatim
                idiom = cuda.current
            except RuntimeError as exc:
                idiom = str(exc)
            fake_torch = types.SimpleNamespace(cuda=FakeCuda(visible), device=lambda *a: a,
                                               __version__="fake", version=None)
            training_device(True, hvd.local_rank(), fake_torch)
            shown = []
            fake_tf = types.SimpleNamespace(config=types.SimpleNamespace(
                list_physical_devices=lambda kind: list(visible),
                set_visible_devices=lambda devices, kind: shown.extend(devices),
                experimental=types.SimpleNamespace(set_memory_growth=lambda gpu, on: None)))
            place_keras(True, hvd.local_rank(), fake_tf)
            return {"rank": hvd.rank(), "host": os.environ["HVD_SPARK_HOSTNAME"],
                    "local_rank": hvd.local_rank(), "own": get_available_devices(),
                    "visible": visible, "index": device_index(), "idiom": idiom,
                    "torch": fake_torch.cuda.current, "keras": shown,
                    "order": os.environ.get("CUDA_DEVICE_ORDER")}
        finally:
            hvd.shutdown()

    return probe


def _by_host(results: list[dict]) -> dict[str, list[dict]]:
    hosts: dict[str, list[dict]] = collections.defaultdict(list)
    for r in sorted(results, key=lambda r: r["local_rank"]):
        hosts[r["host"]].append(r)
    return hosts


@pytest.mark.smoke
def test_one_gpu_per_rank_is_device_local_rank_on_two_hosts(whole_gpus):
    results = hvd_spark.run(_device_probe(), num_proc=4, stdout=io.StringIO())
    hosts = _by_host(results)
    assert sorted(hosts) == ["host-0", "host-1"], results
    for ranks in hosts.values():
        assert [r["local_rank"] for r in ranks] == [0, 1]
        # Spark gave each rank one GPU of its host, none twice: the host's two.
        assert sorted(a for r in ranks for a in r["own"]) == ["0", "1"], ranks
        # The ranks of a host see the same devices, each its own at index local_rank.
        assert all(r["visible"] == ranks[0]["visible"] for r in ranks)
        for r in ranks:
            (own,) = r["own"]
            assert r["visible"][r["local_rank"]] == own and r["index"] == r["local_rank"]
            assert r["idiom"] == r["torch"] == own and r["keras"] == [own]
            assert r["order"] == "PCI_BUS_ID"
    assert [r["rank"] for r in results] == [0, 1, 2, 3]


def _torch_probe():
    """A torch.distributed rank function (shipped by value) gathering, on every rank, what
    each rank sees: its LOCAL_RANK device must be its own Spark GPU."""

    def probe() -> list[dict]:
        import os

        import torch.distributed as dist

        from hvd_spark.task import get_available_devices

        dist.init_process_group("gloo")  # torchrun's env://, across the two hosts
        try:
            visible = [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d]
            mine = {"rank": dist.get_rank(), "host": os.environ["HVD_SPARK_HOSTNAME"],
                    "local_rank": int(os.environ["LOCAL_RANK"]),
                    "group_rank": int(os.environ["GROUP_RANK"]),
                    "device": visible[int(os.environ["LOCAL_RANK"])],
                    "own": get_available_devices()}
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            return everyone
        finally:
            dist.destroy_process_group()

    return probe


def _check_torch_placement(ranks: list[dict]) -> None:
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    hosts = _by_host(ranks)
    assert sorted(hosts) == ["host-0", "host-1"], ranks
    for node, (_, on_host) in enumerate(sorted(hosts.items(), key=lambda h: h[1][0]["rank"])):
        assert [r["local_rank"] for r in on_host] == [0, 1]
        assert {r["group_rank"] for r in on_host} == {node}
        assert sorted(r["device"] for r in on_host) == ["0", "1"]  # each GPU once
        for r in on_host:
            assert r["own"] == [r["device"]], r  # LOCAL_RANK's device is its Spark GPU


@pytest.mark.smoke
def test_torch_distributor_places_one_process_per_spark_gpu(whole_gpus):
    distributor = hvd_spark.TorchDistributor(num_processes=4, local_mode=False, use_gpu=True)
    assert distributor.num_tasks == 4
    _check_torch_placement(distributor.run(_torch_probe()))


def test_use_gpu_false_leaves_the_executors_devices(whole_gpus):
    def devices():
        import os

        from hvd_spark.task import device_index, get_available_devices

        return get_available_devices(), os.environ.get("CUDA_VISIBLE_DEVICES"), device_index()

    results = hvd_spark.run(devices, num_proc=2, use_gpu=False, stdout=io.StringIO())
    # Horovod's behaviour: the rank still learns its addresses, CUDA is left as it was.
    executors = os.environ.get("CUDA_VISIBLE_DEVICES")  # local executors inherit ours
    assert all(len(own) == 1 and cuda == executors and index is None
               for own, cuda, index in results), results


def test_run_elastic_workers_learn_their_gpus_and_keep_the_executors_devices(whole_gpus):
    def devices():
        import os

        import hvd_spark.collectives as hvd
        from hvd_spark.task import device_index, get_available_devices

        hvd.init()
        try:
            return get_available_devices(), device_index(), os.environ.get("CUDA_VISIBLE_DEVICES")
        finally:
            hvd.shutdown()

    results = hvd_spark.run_elastic(devices, num_proc=4, min_np=4, start_timeout=120,
                                    stdout=io.StringIO(), stderr=io.StringIO())
    executors = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert len(results) == 4
    for own, index, cuda in results:
        (address,) = own  # the task's Spark GPU, as under hvd_spark.run
        assert cuda == executors  # a worker's local rank changes: its devices do not
        visible = executors.split(",") if executors is not None else None
        assert index == (int(address) if visible is None else visible.index(address))


def test_shared_gpus_are_listed_once_and_each_rank_knows_its_own(half_gpus):
    results = hvd_spark.run(_device_probe(), num_proc=4, stdout=io.StringIO())
    (ranks,) = _by_host(results).values()
    owners = collections.Counter(a for r in ranks for a in r["own"])
    assert owners == {"0": 2, "1": 2}, ranks  # half a GPU each, as Spark assigned them
    first_seen = list(dict.fromkeys(r["own"][0] for r in ranks))  # in local-rank order
    for r in ranks:
        (own,) = r["own"]
        assert r["visible"] == first_seen  # each GPU once: CUDA refuses duplicates
        assert r["visible"][r["index"]] == own
        assert r["torch"] == own and r["keras"] == [own]  # the Estimators' choice
    # Horovod's idiom cannot work with four ranks on two GPUs (documented): HVD_SPARK_GPU_INDEX.
    assert [r["idiom"] for r in ranks[2:]] == ["CUDA error: invalid device ordinal 2",
                                              "CUDA error: invalid device ordinal 3"]


def test_torch_distributor_runs_a_process_per_gpu_of_a_multi_gpu_task(two_gpu_tasks):
    distributor = hvd_spark.TorchDistributor(num_processes=4, local_mode=False, use_gpu=True)
    assert (distributor.num_tasks, distributor.ranks_per_task) == (2, 2)
    _check_torch_placement(distributor.run(_torch_probe()))
    with pytest.raises(ValueError, match="multiple of spark.task.resource.gpu.amount=2"):
        hvd_spark.TorchDistributor(num_processes=3, local_mode=False, use_gpu=True)
    # num_proc's default counts GPUs per task: one task per host here, not two.
    assert len(hvd_spark.run(lambda: 0, stdout=io.StringIO())) == 2
