"""hvd_spark.run and TorchEstimator.fit on Spark standalone clusters of namespace hosts.

Every host has its own address, hostname and /dev/shm, so ranks on different hosts talk
over TCP through the bridge, and ranks on one host over shared memory.
"""

from __future__ import annotations

import io
import sys

import cloudpickle
import numpy as np
import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest
import torch
from pyspark.ml.feature import VectorAssembler

import hvd_spark
from hvd_spark.errors import WorkerFailedError
from hvd_spark.estimator import TorchEstimator

# The executors cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _placement():
    import socket

    import hvd_spark.collectives as hvd
    from hvd_spark.collectives import _plumbing
    from hvd_spark.collectives.tcp.links import TcpLink

    hvd.init()
    comm = _plumbing.current_engine().comm
    tcp_peers = sorted(p for p, link in comm.links.items() if isinstance(link, TcpLink))
    addrs = sorted({comm.links[p].sock.getpeername()[0] for p in tcp_peers})
    return {"addrs": addrs, "rank": hvd.rank(), "size": hvd.size(),
            "local": (hvd.local_rank(), hvd.local_size()),
            "cross": (hvd.cross_rank(), hvd.cross_size()), "host": socket.gethostname(),
            "tcp_peers": tcp_peers, "shm_peers": comm.shm_peers}


def test_ranks_are_assigned_host_by_host(cluster):
    net, _, per_host = cluster
    n = net.count * per_host
    out = io.StringIO()
    results = hvd_spark.run(_placement, num_proc=n, start_timeout=120, stdout=out)
    # Spark places partitions on executors as it likes: hosts come in the order of
    # their lowest partition, each host's ranks consecutive.
    order = list(dict.fromkeys(got["host"] for got in results))
    assert sorted(order) == sorted(net.hostnames)
    for r, got in enumerate(results):
        host, local = divmod(r, per_host)
        assert got["rank"] == r and got["size"] == n
        assert got["local"] == (local, per_host)
        assert got["cross"] == (host, net.count)
        assert got["host"] == order[host]
        same_host = {host * per_host + k for k in range(per_host)} - {r}
        # Neighbours on the same host share memory; every other host is reached over TCP.
        assert set(got["shm_peers"]) <= same_host
        assert set(got["tcp_peers"]) >= set(range(n)) - same_host - {r}
        # Without an interface setting, ranks use the address they reach the driver from.
        assert set(got["addrs"]) <= set(net.addrs)


def _collectives(nbig: int):
    import numpy as np

    import hvd_spark.collectives as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    big = np.arange(nbig, dtype=np.float32) * (r + 1)
    out = {
        "sum": hvd.allreduce(big, op=hvd.Sum, name="big"),
        "avg": hvd.allreduce(np.full(5, float(r)), name="avg"),
        "min": hvd.allreduce(np.array([r, -r], np.int64), op=hvd.Min),
        "max": hvd.allreduce(np.array([r, -r], np.int64), op=hvd.Max),
        "gather": hvd.allgather(np.full((r + 1, 2), r, np.int32)),
        "bcast": hvd.broadcast(np.arange(3) + r, root_rank=n - 1),
        "rs": hvd.reducescatter(np.ones((2 * n + 1, 3)) * (r + 1), op=hvd.Sum),
        "grouped": hvd.grouped_allreduce([np.ones(3) * r, np.ones(7) * 2 * r], op=hvd.Sum),
        "obj": hvd.broadcast_object({"root": r}, root_rank=1),
        "objs": hvd.allgather_object(r * 10),
    }
    splits = [1 + (r + d) % 2 for d in range(n)]
    send = np.concatenate([np.full(s, 100 * r + d) for d, s in enumerate(splits)])
    out["a2a"] = hvd.alltoall(send, splits=splits)
    hvd.barrier()
    return out


def test_every_collective_is_correct_across_hosts(cluster):
    net, _, per_host = cluster
    n = net.count * per_host
    nbig = 3 << 20  # 12 MB: many pipelined chunks cross every host boundary
    results = hvd_spark.run(_collectives, args=(nbig,), num_proc=n, start_timeout=120)
    ranks = range(n)
    want_sum = np.arange(nbig, dtype=np.float64) * sum(k + 1 for k in ranks)
    for r, out in enumerate(results):
        np.testing.assert_allclose(out["sum"], want_sum, rtol=1e-6)
        np.testing.assert_allclose(out["avg"], np.full(5, sum(ranks) / n))
        assert out["min"].tolist() == [0, -(n - 1)] and out["max"].tolist() == [n - 1, 0]
        assert out["gather"].tolist() == [[k, k] for k in ranks for _ in range(k + 1)]
        assert out["bcast"].tolist() == [n - 1, n, n + 1]
        rows = (2 * n + 1) // n + (1 if r < (2 * n + 1) % n else 0)
        assert out["rs"].shape == (rows, 3) and (out["rs"] == sum(k + 1 for k in ranks)).all()
        total = sum(ranks)
        assert [g.tolist() for g in out["grouped"]] == [[total] * 3, [2 * total] * 7]
        assert out["obj"] == {"root": 1} and out["objs"] == [10 * k for k in ranks]
        received, got_splits = out["a2a"]
        want_splits = [1 + (s + r) % 2 for s in ranks]
        assert got_splits.tolist() == want_splits
        assert received.tolist() == [100 * s + r for s in ranks for _ in range(want_splits[s])]


_W = np.array([1.0, -1.5, 0.5])


def _frame(spark, n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3))
    rows = [(float(a), float(b), float(c), int(v > 0)) for (a, b, c), v in zip(x, x @ _W)]
    df = spark.createDataFrame(rows, "a double, b double, c double, label long")
    return VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(df)


# One cluster shape is enough here: a fit costs about a minute on two cores.
@pytest.mark.parametrize("cluster", [(2, 2)], ids=["2hostsx2"], indirect=True)
def test_torch_estimator_fits_across_hosts(cluster, tmp_path):
    # tmp_path is on the machine's file system, which every namespace host sees:
    # the Store is a path every host shares, as a cluster's NFS or HDFS would be.
    net, spark, per_host = cluster
    n = net.count * per_host
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    # Adam at 0.05 / n: the ranks train at n x the rate (Horovod's rule), 0.05 in all.
    est = TorchEstimator(
        num_proc=n, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.05 / n),
        loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"],
        batch_size=32, epochs=3, validation=0.2, store=str(tmp_path / "store"), verbose=0)
    fitted = est.fit(_frame(spark, 800, 0))
    history = fitted.getHistory()
    assert len(history) == 3
    # The ranks on both hosts trained one model together: the loss fell clearly (transform
    # is tested on one host; here it would only add a Spark job).
    assert history[-1]["train"]["loss"] < 0.8 * history[0]["train"]["loss"], history
    assert history[-1]["validation"]["loss"] < history[0]["validation"]["loss"], history
    weights = dict(fitted.getModel().named_parameters())
    assert all(torch.isfinite(w).all() for w in weights.values())


def _peer_addresses():
    import hvd_spark.collectives as hvd
    from hvd_spark.collectives import _plumbing
    from hvd_spark.collectives.tcp.links import TcpLink

    hvd.init()
    links = _plumbing.current_engine().comm.links.values()
    return sorted(link.sock.getpeername()[0] for link in links if isinstance(link, TcpLink))


@pytest.mark.parametrize("cluster", [(3, 1)], ids=["3hostsx1"], indirect=True)
def test_the_interface_variable_picks_the_network(cluster):
    net, _, _ = cluster
    if "data1" not in net.interfaces:
        net.add_network("data1")
    data_addrs = net.interfaces["data1"]
    # HVD_SPARK_IFACE is hvdrun --network-interface's variable (test_hvdrun_hosts.py).
    results = hvd_spark.run(_peer_addresses, num_proc=3, start_timeout=60,
                            env={"HOROVOD_GLOO_IFACE": "data1"})
    for peers in results:
        assert len(peers) == 2 and set(peers) <= set(data_addrs), peers


@pytest.mark.parametrize("cluster", [(3, 1)], ids=["3hostsx1"], indirect=True)
def test_a_wrong_interface_is_a_clear_error(cluster):
    net, _, _ = cluster
    if "nowhere0" not in net.interfaces:
        net.add_dummy("nowhere0")
    hvd_spark.run(_peer_addresses, num_proc=3, start_timeout=120)  # warm Python workers
    with pytest.raises(WorkerFailedError) as caught:
        hvd_spark.run(_peer_addresses, num_proc=3, start_timeout=10,
                      env={"HVD_SPARK_IFACE": "nowhere0"})
    # The rank that cannot dial names the peer, its host, the address and the fix.
    message = str(caught.value)
    assert "advertised 172.31." in message and "HVD_SPARK_IFACE" in message, message
    assert "on host hvdhost" in message


def _reduce_until_cut(marker: str):
    import time

    import numpy as np

    import hvd_spark.collectives as hvd

    hvd.init()
    grad = np.ones(1 << 20, np.float32)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        hvd.allreduce_(grad, name="grad", op=hvd.Average)
        if hvd.rank() == 0:
            open(marker, "a").close()  # the test cuts a link once this exists
    return "never cut"


# Last on the 3-host cluster: cutting a link may cost that host its Spark executor.
@pytest.mark.parametrize("cluster", [(3, 1)], ids=["3hostsx1"], indirect=True)
def test_a_link_cut_mid_allreduce_fails_both_sides_naming_the_host(cluster, tmp_path):
    import os
    import threading
    import time

    net, _, _ = cluster
    marker = str(tmp_path / "reducing")
    cut_at: list[float] = []
    stop = threading.Event()

    def cut_when_reducing():
        while not stop.is_set():
            if os.path.exists(marker):
                net.set_link(2, up=False)
                cut_at.append(time.monotonic())
                return
            time.sleep(0.05)

    cutter = threading.Thread(target=cut_when_reducing)
    cutter.start()
    try:
        with pytest.raises(WorkerFailedError) as caught:
            hvd_spark.run(_reduce_until_cut, args=(marker,), num_proc=3, start_timeout=120,
                          env={"HVD_SPARK_HEARTBEAT_S": "3", "HVD_SPARK_TIMEOUT": "100"})
        took = time.monotonic() - cut_at[0]
    finally:
        stop.set()
        cutter.join(5)
        net.set_link(2, up=True)
    message = str(caught.value)
    # Within a few heartbeat intervals, far from the 100 s collective timeout.
    assert took < 30, (took, message)
    root = caught.value.root_cause
    assert root.host == net.hostnames[2], message
    assert f"rank {root.rank}" in message and "heartbeat" in message, message
    # The ranks on the other side are stopped too: the Spark job ends with all three.
    assert sorted(f.rank for f in caught.value.failures) == [0, 1, 2]
