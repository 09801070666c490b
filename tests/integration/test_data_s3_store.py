"""Store, ShardReader, prepare_data and model.save on a real S3 API: moto's server on
loopback, via pyarrow's S3, with ``s3://`` and Hadoop's ``s3a://`` URLs.

The Spark tests write from real local[2] tasks, which get the endpoint and credentials
from the pickled Store (``storage_options``), not from their environment.
"""

from __future__ import annotations

import pickle
import socket

import moto.server as moto_server  # CI installs it: never a skip
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_spark.data import FilesystemStore, ShardReader, Store
from hvd_spark.data import dataset_index as util
from hvd_spark.data.parquet_spec import spec_from_parquet
from hvd_spark.errors import ConfigError


@pytest.fixture(scope="module")
def endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def store(endpoint, monkeypatch):
    # pyarrow takes S3 credentials from the environment, as it would on a real worker.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    url = (f"s3://hvd-bucket/prefix?endpoint_override={endpoint}&scheme=http"
           "&region=us-east-1&allow_bucket_creation=true")
    store = Store.create(url)
    store.filesystem.create_dir("hvd-bucket")
    return store


def test_store_roundtrip_on_s3(store):
    assert type(store) is FilesystemStore and store.filesystem.type_name == "s3"
    store.write_json("runs/r1/logs/meta.json", {"a": 1})
    assert store.read_json("runs/r1/logs/meta.json") == {"a": 1}
    store.save_checkpoint("r1", 0, b"zero")
    store.save_checkpoint("r1", 3, b"three")
    clone = pickle.loads(pickle.dumps(store))
    assert clone.list_checkpoints("r1") == [0, 3]
    assert clone.latest_checkpoint("r1") == (3, b"three")
    store.delete("runs/r1")
    assert not store.exists("runs/r1/logs/meta.json")


def test_reader_on_s3(store):
    fs = store.filesystem
    for i in range(2):
        path = store.path("data", f"part-{i}.parquet")
        with fs.open_output_stream(path) as out:
            pq.write_table(pa.table({"id": np.arange(i * 20, i * 20 + 20)}), out, row_group_size=6)
    urls = [store.url_of("data", f"part-{i}.parquet") for i in range(2)]
    seen = []
    for rank in range(2):
        for batch in ShardReader(urls, rank, 2, 5, seed=4).epoch(1):
            seen += batch["id"].tolist()
    assert sorted(seen) == list(range(40))


@pytest.fixture
def s3a_store(endpoint, store):
    # Horovod users pass s3fs-style storage_options; Spark users write s3a:// URLs.
    options = {"key": "testing", "secret": "testing", "region": "us-east-1",
               "client_kwargs": {"endpoint_url": f"http://{endpoint}"}}
    return Store.create("s3a://hvd-bucket/horovod", storage_options=options)


def test_horovod_methods_on_s3a(s3a_store):
    store = s3a_store
    assert type(store) is FilesystemStore
    log = store.get_logs_path("r2") + "/events.txt"
    assert log == "s3a://hvd-bucket/horovod/runs/r2/logs/events.txt"
    store.write_text(log, "epoch 1")
    assert store.exists(log) and store.read(log) == b"epoch 1"
    store.save_checkpoint("r2", 5, b"five")
    assert store.get_checkpoints("r2") == [
        "s3a://hvd-bucket/horovod/runs/r2/checkpoints/epoch-000005.ckpt"]
    clone = pickle.loads(pickle.dumps(store))
    assert clone.latest_checkpoint("r2") == (5, b"five")
    path = store.get_train_data_path(9)
    with store.filesystem.open_output_stream(store.get_localized_path(path) + "/p.parquet") as out:
        pq.write_table(pa.table({"x": [1, 2]}), out)
    assert store.is_parquet_dataset(path) and store.get_parquet_dataset(path).count_rows() == 2
    spec = spec_from_parquet(store, ["x"], train_path=path)
    assert spec.root_url.startswith("s3a://hvd-bucket/")
    batches = ShardReader(pickle.loads(pickle.dumps(spec)), 0, 1, 1, shuffle=False).epoch(0)
    assert [int(b["x"][0]) for b in batches] == [1, 2]


def test_prepare_data_context_manager_on_s3a(spark, s3a_store):
    from pyspark.ml.linalg import Vectors

    util.clear_training_cache()
    df = spark.createDataFrame([(Vectors.dense([float(i), 1.0]), float(i % 2)) for i in range(40)],
                               ["features", "label"])
    with util.prepare_data(2, s3a_store, df, label_columns=["label"], validation=0.25,
                           partitions_per_process=1) as idx:
        spec = util.load_dataset_spec(s3a_store, idx)
        assert s3a_store.is_parquet_dataset(s3a_store.get_train_data_path(idx))
        assert spec.train.num_rows + spec.val.num_rows == 40
        seen = []
        for split in ("train", "val"):
            for batch in ShardReader(spec, 0, 1, 1, split=split, shuffle=False).epoch(0):
                seen += batch["features"][:, 0].astype(int).tolist()
        assert sorted(seen) == list(range(40))


def test_model_save_and_load_on_s3a(spark, store, tmp_path):
    import torch
    from pyspark.ml.feature import VectorAssembler

    from hvd_spark.estimator import TorchEstimator, TorchModel

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 2))
    rows = [(float(a), float(b), float(a + b > 0)) for a, b in x]
    df = VectorAssembler(inputCols=["a", "b"], outputCol="features").transform(
        spark.createDataFrame(rows, ["a", "b", "label"]))
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    est = TorchEstimator(num_proc=1, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                         loss=torch.nn.BCEWithLogitsLoss(), feature_cols=["features"],
                         label_cols=["label"], batch_size=16, epochs=1,
                         store=str(tmp_path / "store"))
    model = est.fit(df)
    url = "s3a://hvd-bucket/prefix/models/m"  # no query: the store's options apply
    model.save(url)
    # Metadata and blobs both went to S3 (before, the metadata went through Hadoop).
    assert store.list_files("models/m/metadata") == ["_SUCCESS", "part-00000"]
    assert "params.pkl" in store.list_files("models/m/data")
    assert len(store.list_files("models/m/data")) >= 2  # the trained model's bytes too
    with pytest.raises(ConfigError, match="already exists"):
        model.save(url)
    model.write().overwrite().save(url)
    loaded = TorchModel.load(url)
    assert loaded.uid == model.uid and loaded.getHistory() == model.getHistory()
    column = [c for c in model.transform(df).columns if c not in df.columns][0]
    a = [r[column] for r in model.transform(df).orderBy("a").collect()]
    b = [r[column] for r in loaded.transform(df).orderBy("a").collect()]
    assert a == b and len(a) == 64
    with pytest.raises(ConfigError, match="no saved estimator or model"):
        TorchModel.load("s3a://hvd-bucket/prefix/models/none")
