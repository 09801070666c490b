"""Store and ShardReader on a real S3 API: moto's server on loopback, via pyarrow's S3.

Spark does not take part (writing from Spark to S3 goes through the same Store code,
inside tasks, which tests/integration/test_data_writer.py exercises on a local store).
"""

from __future__ import annotations

import pickle
import socket

import moto.server as moto_server  # CI installs it: never a skip
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_spark.data import ShardReader, Store


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
    assert type(store) is Store and store.filesystem.type_name == "s3"
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
