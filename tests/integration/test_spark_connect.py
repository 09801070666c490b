"""hvd_spark.run and TorchEstimator fit + transform over Spark Connect, against a real
local Spark Connect server (local[2]) started by the module's fixture."""

from __future__ import annotations

import io
import os
import time

import numpy as np
import pytest

import hvd_spark
from hvd_spark.errors import WorkerFailedError
from hvd_spark.runner.spark import spark_launcher
from hvd_spark.runner.spark.connect import ConnectContext
from tests.integration.connect_server import ConnectServer
from tests.integration.elastic_jobs import count_steps

_MODE_VARS = ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE", "SPARK_LOCAL_REMOTE")
# The first test also waits for the server's JVM to start; fits over Connect on a loaded
# 2-core machine take minutes.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def connect(tmp_path_factory):
    """A Spark Connect session on a fresh local server; classic mode is restored after."""
    from pyspark.sql import SparkSession

    saved = {k: os.environ.get(k) for k in _MODE_VARS}
    # pyspark refuses a remote session while a classic one runs in this process (an
    # earlier module's): stop it; the next classic module's fixture starts its own.
    classic = SparkSession.getActiveSession()
    if classic is not None:
        classic.stop()
    server = ConnectServer(tmp_path_factory.mktemp("connect") / "server.log")
    try:
        server.wait_ready()
        session = SparkSession.builder.remote(server.url).getOrCreate()
        yield session
        session.stop()
    finally:
        server.stop()
        for key, value in saved.items():  # pyspark switches the whole process to Connect
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _allreduce(scale):
    import os

    import numpy as np

    import hvd_spark.collectives as hvd

    hvd.init()
    print(f"rank {hvd.rank()} of {hvd.size()}")
    out = hvd.allreduce(np.full(3, float(hvd.rank() + 1) * scale), op=hvd.Sum).tolist()
    return out, os.getppid()


def test_the_launcher_reads_a_connect_session(connect):
    assert spark_launcher.active_session() is connect
    context = spark_launcher.cluster_context(connect)
    assert isinstance(context, ConnectContext)
    assert context.master == "local[2]"
    assert context.defaultParallelism == 2
    assert spark_launcher.task_slots(context) == 2
    # The service runs in this client; executors on this machine reach it on loopback.
    assert spark_launcher.driver_hosts(context) == ("127.0.0.1", "127.0.0.1")
    with pytest.raises(hvd_spark.errors.ConfigError, match="num_proc=3"):
        spark_launcher.check_cluster(context, 3)


@pytest.mark.smoke
def test_run_over_connect(connect):
    out = io.StringIO()
    results = hvd_spark.run(_allreduce, args=(10,), num_proc=2, stdout=out)
    assert [r[0] for r in results] == [[30.0, 30.0, 30.0]] * 2
    # Each rank is a child of a Python worker of the server's executors, not of this client.
    assert all(parent != os.getpid() for _, parent in results)
    assert "[0] rank 0 of 2" in out.getvalue() and "[1] rank 1 of 2" in out.getvalue()


def _torch_ranks(tag):
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        print(f"{tag}: rank {dist.get_rank()} sum {t.item():g}", flush=True)
        return t.item(), dist.get_rank(), os.getppid()
    finally:
        dist.destroy_process_group()


def test_torch_distributor_over_connect_with_live_logs(connect, capsys):
    distributor = hvd_spark.TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    total, rank, parent = distributor.run(_torch_ranks, "connect")
    assert (total, rank) == (3.0, 0) and parent != os.getpid()
    out = capsys.readouterr().out
    assert "[0] connect: rank 0 sum 3" in out and "[1] connect: rank 1 sum 3" in out


def test_run_elastic_over_connect(connect):
    err = io.StringIO()
    results = hvd_spark.run_elastic(count_steps, args=(12,), num_proc=2, min_np=1,
                                    start_timeout=120, stdout=io.StringIO(), stderr=err)
    assert results == [(0, 2, 12, 24.0), (1, 2, 12, 24.0)]
    assert "generation 1: 2 ranks" in err.getvalue()
    # The run's tagged job ended with it: the session runs the next job at once.
    assert connect.range(3).count() == 3


def _fail_on_rank_1():
    import time

    import hvd_spark.collectives as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank 1 cannot go on over Connect")
    time.sleep(120)  # stopped by the driver when rank 1 fails


def test_failure_over_connect_has_the_remote_traceback_and_cancels(connect):
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        hvd_spark.run(_fail_on_rank_1, num_proc=2, stdout=io.StringIO(), stderr=io.StringIO())
    elapsed = time.monotonic() - started
    text = str(info.value)
    assert "ValueError: rank 1 cannot go on over Connect" in text
    assert "_fail_on_rank_1" in text  # the remote traceback names the function
    assert info.value.failures[0].rank == 1
    assert elapsed < 60, f"the run took {elapsed:.0f} s to end after the failure"
    # The tagged job was interrupted: the session runs the next job at once.
    assert connect.range(3).count() == 3


def test_torch_estimator_fit_and_transform_over_connect(connect, tmp_path):
    import torch
    from pyspark.sql import functions as F

    from hvd_spark.estimator import TorchEstimator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 4))
    y = (x @ np.array([1.5, -2.0, 0.75, 0.0]) > 0).astype(int)
    rows = [(*map(float, r), int(label)) for r, label in zip(x, y)]
    frame = connect.createDataFrame(rows, "a double, b double, c double, d double, label long")
    frame = frame.select(F.array("a", "b", "c", "d").alias("features"), "label")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    estimator = TorchEstimator(
        num_proc=2, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.02),
        loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"],
        batch_size=32, epochs=3, store=str(tmp_path / "store"), verbose=0, validation=0.2)
    fitted = estimator.fit(frame)
    history = fitted.getHistory()
    assert len(history) == 3 and history[-1]["train"]["loss"] < history[0]["train"]["loss"]
    predictions = fitted.transform(frame).select("label", "label__output").collect()
    assert len(predictions) == 600
    accuracy = np.mean([int(np.argmax(r["label__output"])) == r["label"] for r in predictions])
    assert accuracy > 0.9


def _slot_holder(marker: str):
    def hold_slot(batches):
        import time

        for _ in batches:
            pass
        open(marker, "w").close()  # the task is running: the test goes on
        time.sleep(90)
        yield from ()

    return hold_slot


def test_a_run_that_cannot_start_is_interrupted_by_its_tag(connect, tmp_path):
    import threading

    from hvd_spark.errors import RendezvousTimeoutError

    # Another job holds one of the two slots: the barrier stage cannot start, the run
    # times out, and its tagged job must be interrupted rather than left waiting.
    errors: list[BaseException] = []

    def hold():
        connect.addTag("slot-holder")
        try:
            connect.range(1, numPartitions=1).mapInArrow(_slot_holder(marker),
                                                         "id long").collect()
        except Exception as exc:
            errors.append(exc)

    marker = str(tmp_path / "holding")
    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(marker), "the slot holder's task never ran"
        started = time.monotonic()
        with pytest.raises(RendezvousTimeoutError, match="0 of 2 Spark tasks started"):
            hvd_spark.run(_allreduce, args=(1,), num_proc=2, start_timeout=5,
                          stdout=io.StringIO())
        assert time.monotonic() - started < 40
        # The holder still has its slot, so the barrier job could only have ended by
        # being interrupted through its tag.
        assert holder.is_alive()
        assert not [t for t in threading.enumerate() if t.name == "hvd-spark-job"]
    finally:
        connect.interruptTag("slot-holder")
        holder.join(30)
    assert not holder.is_alive() and errors  # the holder was interrupted too
    # Nothing of the run is left queued: a two-task job gets both slots at once.
    assert len(connect.range(2, numPartitions=2).collect()) == 2


def test_keras_estimator_fit_and_transform_over_connect(connect, tmp_path):
    import keras
    from pyspark.sql import functions as F

    from hvd_spark.estimator import KerasEstimator

    rng = np.random.default_rng(1)
    x = rng.normal(size=(600, 4))
    y = (x @ np.array([1.5, -2.0, 0.75, 0.0]) > 0).astype(float)
    rows = [(*map(float, r), float(label)) for r, label in zip(x, y)]
    frame = connect.createDataFrame(rows, "a double, b double, c double, d double, label double")
    frame = frame.select(F.array("a", "b", "c", "d").alias("features"), "label")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    fitted = KerasEstimator(
        num_proc=2, model=model, optimizer=keras.optimizers.Adam(0.02),
        loss="binary_crossentropy", feature_cols=["features"], label_cols=["label"],
        batch_size=32, epochs=3, store=str(tmp_path / "store"), verbose=0).fit(frame)
    assert fitted.getHistory()["loss"][-1] < fitted.getHistory()["loss"][0]
    predictions = fitted.transform(frame).select("label", "label__output").collect()
    assert len(predictions) == 600
    accuracy = np.mean([(r["label__output"] > 0.5) == (r["label"] > 0.5) for r in predictions])
    assert accuracy > 0.9
