"""Store: layout, atomic bytes/JSON, checkpoints, pickling, URL dispatch."""

from __future__ import annotations

import os
import pickle

import pytest

from hvd_spark.data.store import (
    DBFSLocalStore,
    FilesystemStore,
    HDFSStore,
    LocalStore,
    Store,
    join_url,
)
from hvd_spark.errors import ConfigError


def test_create_picks_class_from_prefix(tmp_path):
    assert type(Store.create(str(tmp_path))) is LocalStore
    assert Store.create(f"file://{tmp_path}").url == str(tmp_path)
    assert type(Store.create("hdfs://nn:8020/x")) is HDFSStore
    dbfs = Store.create("dbfs:/ml/runs")
    assert type(dbfs) is DBFSLocalStore and dbfs.url == "/dbfs/ml/runs"
    assert type(Store.create("s3://bucket/prefix")) is FilesystemStore
    with pytest.raises(ConfigError, match="LocalStore needs a local path"):
        LocalStore("s3://bucket/x")
    with pytest.raises(ConfigError, match="HDFSStore needs an hdfs://"):
        HDFSStore("s3://bucket/x")


def test_unsupported_scheme_is_a_config_error():
    store = Store.create("nosuchfs://host/x")
    with pytest.raises(ConfigError, match="cannot open a filesystem for 'nosuchfs://host/x'"):
        store.exists("a")


def test_layout(tmp_path):
    store = Store.create(str(tmp_path))
    assert store.train_data_path("k1") == "intermediate_train_data/k1/train"
    assert store.val_data_path("k1") == "intermediate_train_data/k1/val"
    assert store.spec_path("k1") == "intermediate_train_data/k1/spec.json"
    assert store.checkpoints_path("r") == "runs/r/checkpoints"
    assert store.logs_path("r") == "runs/r/logs"
    assert store.path("runs/r") == f"{tmp_path}/runs/r"
    assert store.url_of("a", "b") == os.path.join(str(tmp_path), "a", "b")
    for bad in ("", "a/b", "..", None):
        with pytest.raises(ConfigError, match="run_id must be"):
            store.run_path(bad)


def test_join_url_keeps_query():
    url = "s3://bkt/pfx?endpoint_override=127.0.0.1:9000&scheme=http"
    assert join_url(url, "a/", "/b") == "s3://bkt/pfx/a/b?endpoint_override=127.0.0.1:9000&scheme=http"


def test_bytes_json_atomic_and_delete(tmp_path):
    store = Store.create(str(tmp_path))
    assert not store.exists("x/y.bin")
    store.write_bytes("x/y.bin", b"one")
    store.write_bytes("x/y.bin", b"two")  # overwrite in place
    assert store.read_bytes("x/y.bin") == b"two"
    store.write_json("x/meta.json", {"a": [1, 2]})
    assert store.read_json("x/meta.json") == {"a": [1, 2]}
    assert store.list_files("x") == ["meta.json", "y.bin"]  # no temp files left behind
    store.delete("x")
    assert not store.exists("x") and store.list_files("x") == []
    with pytest.raises(FileNotFoundError):
        store.read_bytes("x/y.bin")


def test_checkpoints_roundtrip(tmp_path):
    store = Store.create(str(tmp_path))
    assert store.latest_checkpoint("run1") is None
    for epoch in (0, 2, 10):
        store.save_checkpoint("run1", epoch, f"state{epoch}".encode())
    store.write_bytes("runs/run1/checkpoints/notes.txt", b"ignored")
    assert store.list_checkpoints("run1") == [0, 2, 10]
    assert store.latest_checkpoint("run1") == (10, b"state10")
    assert store.latest_checkpoint("run2") is None
    with pytest.raises(ConfigError, match="epoch must be an int"):
        store.save_checkpoint("run1", -1, b"")


def test_pickle_keeps_url_and_recreates_filesystem(tmp_path):
    store = Store.create(str(tmp_path))
    store.write_bytes("f", b"x")  # creates the filesystem object
    clone = pickle.loads(pickle.dumps(store))
    assert clone == store and clone._fs is None
    assert clone.read_bytes("f") == b"x"
    dbfs = pickle.loads(pickle.dumps(DBFSLocalStore("dbfs:/a")))
    assert type(dbfs) is DBFSLocalStore and dbfs.url == "/dbfs/a"


def test_upload_dir_copies_the_tree_and_skips_a_missing_directory(tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    local = tmp_path / "logs"
    (local / "train").mkdir(parents=True)
    (local / "events.out").write_bytes(b"top")
    (local / "train" / "events.out").write_bytes(b"nested")
    logs = store.logs_path("run1")
    store.upload_dir(str(local), logs)
    assert store.read_bytes(f"{logs}/events.out") == b"top"
    assert store.read_bytes(f"{logs}/train/events.out") == b"nested"
    store.upload_dir(str(tmp_path / "never-written"), f"{logs}/other")  # no logs: no error
    assert not store.exists(f"{logs}/other")
