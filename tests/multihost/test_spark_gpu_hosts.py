"""Spark's GPU scheduling on a standalone cluster of two namespace hosts x two fake GPUs.

Each worker discovers GPUs 0 and 1 through a script (``spark.worker.resource.gpu.*``, as
on a real standalone cluster); the application asks for two per executor and one per
task. ``hvd_spark.run(use_gpu=True)`` must show the two ranks of each host that host's
GPUs of the job, each rank's own at device ``local_rank``, so Horovod's
``torch.cuda.set_device(hvd.local_rank())`` (against a fake CUDA over the rank's
``CUDA_VISIBLE_DEVICES``) lands on the GPU Spark assigned. Unlike ``local-cluster``
(tests/integration/test_spark_gpu_scheduling.py), every host has its own hostname and
address, and its worker reads the resource settings from its own configuration.
"""

from __future__ import annotations

import collections
import io
import sys

import cloudpickle
import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest

import hvd_spark
from netns_cluster import services as netns_services
from tests import fake_gpus
from tests.fake_gpus import FakeCuda, write_script
from tests.multihost.conftest import require_namespaces

# The executors cannot import this test module or tests.fake_gpus: ship them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(fake_gpus)


@pytest.fixture(scope="module")
def gpu_hosts(tmp_path_factory):
    """``(hosts, spark)``: 2 namespace hosts, each a worker with 2 cores and GPUs 0 and 1."""
    require_namespaces()
    script = write_script(tmp_path_factory.mktemp("gpu-hosts") / "discover_gpus.sh")
    worker = {"spark.worker.resource.gpu.amount": "2",
              "spark.worker.resource.gpu.discoveryScript": str(script)}
    app = {"spark.executor.resource.gpu.amount": "2",
           "spark.executor.resource.gpu.discoveryScript": str(script),
           "spark.task.resource.gpu.amount": "1"}
    with netns_services.spark_cluster(2, cores=2, worker_conf=worker, conf=app) as cluster:
        yield cluster


def _probe() -> dict:
    import os
    import socket

    import hvd_spark.collectives as hvd
    from hvd_spark.task import get_available_devices

    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]

    hvd.init()
    try:
        cuda = FakeCuda(visible)  # CUDA over the visible devices
        try:
            cuda.set_device(hvd.local_rank())  # Horovod's idiom, verbatim
            idiom = cuda.current
        except RuntimeError as exc:
            idiom = str(exc)
        return {"rank": hvd.rank(), "host": socket.gethostname(),
                "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
                "own": get_available_devices(), "visible": visible,
                "index": os.environ.get("HVD_SPARK_GPU_INDEX"), "idiom": idiom}
    finally:
        hvd.shutdown()


def test_set_device_local_rank_is_the_gpu_spark_assigned_on_each_host(gpu_hosts):
    net, _ = gpu_hosts
    results = hvd_spark.run(_probe, num_proc=4, use_gpu=True, start_timeout=120,
                            stdout=io.StringIO())
    assert [r["rank"] for r in results] == [0, 1, 2, 3], results
    hosts: dict[str, list[dict]] = collections.defaultdict(list)
    for r in sorted(results, key=lambda r: r["local_rank"]):
        hosts[r["host"]].append(r)
    assert sorted(hosts) == sorted(net.hostnames), results  # two ranks on each host
    for ranks in hosts.values():
        assert [(r["local_rank"], r["local_size"]) for r in ranks] == [(0, 2), (1, 2)], ranks
        # Spark gave each rank one GPU of its host, none twice: the host's two.
        assert [len(r["own"]) for r in ranks] == [1, 1], ranks
        assert sorted(r["own"][0] for r in ranks) == ["0", "1"], ranks
        # Both see the host's GPUs of the job, in local-rank order.
        expected = [r["own"][0] for r in ranks]
        for r in ranks:
            assert r["visible"] == expected, ranks
            assert r["index"] == str(r["local_rank"]), ranks
            assert r["idiom"] == r["own"][0], ranks  # set_device(local_rank): its own GPU
