"""``run(fn, df=...)``: ranks train straight from the DataFrame, with no Store.

The barrier tasks read the rows from Spark and each writes its share to its executor's
local disk; the rank reads it through ``dataframe_loader`` / ``dataframe_dataset``. Rank
functions are nested so that cloudpickle ships them by value (local-cluster executors
cannot import ``tests``).
"""

from __future__ import annotations

import io
import os

import numpy as np
import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest

import hvd_spark
from hvd_spark.errors import DataError, WorkerFailedError


def _frame(spark, n: int = 103):
    from pyspark.ml.linalg import Vectors

    rows = [(i, Vectors.dense([float(i), float(i % 7)]), [float(i), 2.0 * i], float(i) / 10)
            for i in range(n)]
    return spark.createDataFrame(rows, ["id", "vec", "arr", "y"])


def _read_epochs():
    def fn(batch_size: int, epochs: int) -> dict:
        import os

        from hvd_spark.data.rank_share import RankShare
        from hvd_spark.torch.dataframe import dataframe_loader

        share = RankShare.current()
        loader = dataframe_loader(batch_size, seed=3)
        orders, first = [], None
        for _ in range(epochs):
            ids = []
            for batch in loader:
                ids += batch["id"].tolist()
                first = first or {k: (str(v.dtype), tuple(v.shape)) for k, v in batch.items()}
                assert batch["vec"][:, 0].tolist() == [float(i) for i in batch["id"].tolist()]
            orders.append(ids)
        everything = share.table.column("id").to_pylist()
        return {"rows": share.num_rows, "min": share.min_rows, "steps": len(loader),
                "orders": orders, "all": everything, "first": first,
                "path": os.environ["HVD_SPARK_SHARE_PATH"]}

    return fn


def _check_shares(results: list[dict], n: int, batch_size: int) -> None:
    everything = sorted(i for r in results for i in r["all"])
    assert everything == list(range(n))  # every row once, in exactly one share
    least = min(r["rows"] for r in results)
    assert max(r["rows"] for r in results) - least <= 1  # round-robin: balanced
    for r in results:
        assert r["min"] == least and r["steps"] == least // batch_size  # equal steps
        assert all(len(o) == r["steps"] * batch_size for o in r["orders"])
        assert set(r["orders"][0]) <= set(r["all"])
        assert r["orders"][0] != r["orders"][1]  # reshuffled each epoch
        assert r["first"] == {"id": ("torch.int64", (batch_size,)),
                              "vec": ("torch.float32", (batch_size, 2)),
                              "arr": ("torch.float32", (batch_size, 2)),
                              "y": ("torch.float32", (batch_size,))}
        assert not os.path.exists(r["path"])  # the task removed its share


@pytest.mark.smoke
def test_ranks_read_their_shares_straight_from_spark(spark) -> None:
    results = hvd_spark.run(_read_epochs(), args=(8, 2), num_proc=2, df=_frame(spark),
                            stdout=io.StringIO())
    _check_shares(results, 103, 8)


def _train():
    def fn(batch_size: int, steps: int) -> dict:
        import torch

        import hvd_spark.torch as hvd
        from hvd_spark.torch.dataframe import dataframe_loader

        hvd.init()
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        seen = []
        loader = dataframe_loader(batch_size, seed=1)
        for batch in loader:
            if len(seen) == steps:
                break
            seen.append(batch["id"].tolist())
            opt.zero_grad()
            pred = model(batch["vec"]).squeeze(1)
            torch.nn.functional.mse_loss(pred, batch["y"]).backward()
            opt.step()
        weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        return {"seen": seen, "weights": weights}

    return fn


def test_training_from_shares_equals_one_process_on_the_same_rows(spark) -> None:
    import torch

    results = hvd_spark.run(_train(), args=(4, 6), num_proc=2, df=_frame(spark, 64),
                            stdout=io.StringIO())
    # One process, the same initial weights, each global batch = both ranks' batches.
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):
        ids = results[0]["seen"][step] + results[1]["seen"][step]
        x = torch.tensor([[float(i), float(i % 7)] for i in ids])
        y = torch.tensor([float(i) / 10 for i in ids])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
        opt.step()
    for name, value in model.state_dict().items():
        for r in results:
            np.testing.assert_allclose(r["weights"][name], value.numpy(), rtol=1e-5, atol=1e-6)


def test_tensorflow_dataset_over_the_share(spark) -> None:
    def fn() -> dict:
        from hvd_spark.tensorflow.dataframe import dataframe_dataset

        dataset = dataframe_dataset(4, seed=2)
        epochs = [[b["id"].numpy().tolist() for b in dataset] for _ in range(2)]
        spec = {k: (v.dtype.name, tuple(v.shape)) for k, v in dataset.element_spec.items()}
        return {"epochs": epochs, "spec": spec,
                "cardinality": int(dataset.cardinality().numpy())}

    results = hvd_spark.run(fn, num_proc=2, df=_frame(spark, 20), stdout=io.StringIO())
    for r in results:
        assert r["cardinality"] == 2 and [len(e) for e in r["epochs"]] == [2, 2]
        assert r["epochs"][0] != r["epochs"][1]
        assert r["spec"]["vec"] == ("float32", (None, 2)) and r["spec"]["id"][0] == "int64"


def test_uneven_and_bad_input(spark) -> None:
    def steps(batch_size: int) -> int:
        from hvd_spark.torch.dataframe import dataframe_loader

        return len(dataframe_loader(batch_size))

    # 3 rows on 2 ranks: shares of 1 and 2 rows; the smallest decides the steps.
    assert hvd_spark.run(steps, args=(1,), num_proc=2, df=_frame(spark, 3),
                         stdout=io.StringIO()) == [1, 1]
    with pytest.raises(WorkerFailedError, match="larger than the smallest rank's share"):
        hvd_spark.run(steps, args=(2,), num_proc=2, df=_frame(spark, 3), stdout=io.StringIO(),
                      stderr=io.StringIO())
    with pytest.raises(DataError, match="1 rows, fewer than the 2 ranks"):
        hvd_spark.run(steps, args=(1,), num_proc=2, df=_frame(spark, 1))
    strings = spark.createDataFrame([("a", 1.0), ("b", 2.0)], ["name", "x"])
    with pytest.raises(DataError, match="column 'name' has type string"):
        hvd_spark.run(steps, args=(1,), num_proc=2, df=strings)


def test_rows_are_dealt_in_turn_into_one_partition_per_rank(spark) -> None:
    """``deal_round_robin`` (no sort first): row ``i`` of a one-partition frame lands in
    partition ``i mod n``, and five partitions of 200 rows deal into sizes that differ
    by at most the number of input partitions (each starts one turn further), every row
    once."""
    from hvd_spark.data.shares import deal_round_robin

    one = spark.range(10, numPartitions=1)
    dealt = deal_round_robin(one, 3).rdd.mapPartitions(
        lambda rows: [[row["id"] for row in rows]]).collect()
    assert dealt == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    for n in (2, 3, 4, 7):
        frame = deal_round_robin(spark.range(1000, numPartitions=5), n)
        assert frame.columns == ["id"]
        parts = frame.rdd.mapPartitions(lambda rows: [[row["id"] for row in rows]]).collect()
        sizes = [len(p) for p in parts]
        assert len(sizes) == n and max(sizes) - min(sizes) <= min(5, n - 1), (n, sizes)
        assert sorted(i for p in parts for i in p) == list(range(1000))


def test_a_killed_rank_leaves_no_share_behind(spark) -> None:
    def die() -> None:
        import os
        import signal

        from hvd_spark.data.rank_share import RankShare

        share = RankShare.current()
        print("share at", os.environ["HVD_SPARK_SHARE_PATH"], flush=True)
        if os.environ["HVD_SPARK_RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        share.table.num_rows  # noqa: B018 - rank 0 holds its share open while 1 dies
        import time

        time.sleep(60)

    out = io.StringIO()
    with pytest.raises(WorkerFailedError):
        hvd_spark.run(die, num_proc=2, df=_frame(spark, 10), stdout=out, stderr=io.StringIO())
    paths = [line.split("share at ")[1] for line in out.getvalue().splitlines()
             if "share at" in line]
    assert len(paths) == 2 and not any(os.path.exists(p) for p in paths)


def test_torch_distributor_trains_on_a_dataframe(spark) -> None:
    def fn(scale: int) -> int:
        import torch.distributed as dist

        from hvd_spark.torch.dataframe import dataframe_loader

        dist.init_process_group("gloo")
        try:
            return scale * sum(len(b["id"]) for b in dataframe_loader(2))
        finally:
            dist.destroy_process_group()

    distributor = hvd_spark.TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    assert distributor.train_on_dataframe(fn, _frame(spark, 11), 10) == 40
    with pytest.raises(ValueError, match="local_mode=False"):
        hvd_spark.TorchDistributor(2, local_mode=True, use_gpu=False).train_on_dataframe(
            fn, _frame(spark, 11), 1)


def test_a_tracked_run_logs_its_dataframe_as_an_mlflow_input(spark, mlflow_client,
                                                             tmp_path) -> None:
    import json

    import mlflow

    def rows() -> int:
        from hvd_spark.data.rank_share import RankShare

        return RankShare.current().num_rows

    path = str(tmp_path / "train.parquet")
    _frame(spark, 12).select("id", "y").write.parquet(path)
    df = spark.read.parquet(path)
    with mlflow.start_run() as run:
        assert sum(hvd_spark.run(rows, num_proc=2, df=df, stdout=io.StringIO())) == 12
    (logged,) = mlflow_client.get_run(run.info.run_id).inputs.dataset_inputs
    assert logged.dataset.source_type == "spark"
    assert json.loads(logged.dataset.source)["path"].endswith("train.parquet")
    assert {f["name"] for f in json.loads(logged.dataset.schema)["mlflow_colspec"]} == {"id", "y"}
    assert logged.dataset.digest
    assert {t.key: t.value for t in logged.tags}["mlflow.data.context"] == "training"


def test_run_local_reads_shares_a_local_spark_job_wrote(spark) -> None:
    results = hvd_spark.run_local(_read_epochs(), args=(4, 2), num_proc=3, df=_frame(spark, 50),
                                  stdout=io.StringIO())
    _check_shares(results, 50, 4)  # the shares' directory is gone too
    assert len({os.path.dirname(r["path"]) for r in results}) == 1
    assert not os.path.exists(os.path.dirname(results[0]["path"]))


# Last: the local-cluster session replaces the module's local[2] one.
def test_shares_on_two_executors_of_a_local_cluster(spark_cluster) -> None:
    results = hvd_spark.run(_read_epochs(), args=(5, 2), num_proc=2,
                            df=_frame(spark_cluster, 40), stdout=io.StringIO())
    _check_shares(results, 40, 5)
