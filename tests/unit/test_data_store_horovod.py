"""Horovod's Store API on a real local filesystem: constructors, Store.create, every method.

HDFS is covered for construction and paths only: there is no namenode (nor libhdfs) here,
and the filesystem is created lazily, on first use, so that construction never needs one.
"""

from __future__ import annotations

import os
import pickle
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_spark.data import (
    AbstractFilesystemStore,
    DBFSLocalStore,
    FilesystemStore,
    HDFSStore,
    LocalStore,
    Store,
)
from hvd_spark.errors import ConfigError


def test_local_store_constructor_and_paths(tmp_path):
    store = LocalStore(str(tmp_path))
    uri = f"file://{tmp_path}"
    assert isinstance(store, FilesystemStore) and isinstance(store, AbstractFilesystemStore)
    assert store.get_train_data_path() == f"{uri}/intermediate_train_data"
    assert store.get_train_data_path(2) == f"{uri}/intermediate_train_data.2"
    assert store.get_val_data_path() == f"{uri}/intermediate_val_data"
    assert store.get_val_data_path(0) == f"{uri}/intermediate_val_data.0"
    assert store.get_test_data_path(1) == f"{uri}/intermediate_test_data.1"
    assert store.get_runs_path() == f"{uri}/runs"
    assert store.get_run_path("r1") == f"{uri}/runs/r1"
    assert store.get_checkpoint_path("r1") == f"{uri}/runs/r1/checkpoints"
    assert store.get_logs_path("r1") == f"{uri}/runs/r1/logs"
    assert store.get_logs_subdir() == "logs"
    assert store.get_checkpoint_filename() == "checkpoint"
    assert store.saving_runs() is True
    assert store.get_full_path("a/b") == f"{uri}/a/b"
    assert store.get_full_path(str(tmp_path / "x")) == f"{uri}/x"
    assert store.get_localized_path(f"{uri}/a/b") == f"{tmp_path}/a/b"
    assert store.get_localized_path("a/b") == f"{tmp_path}/a/b"
    assert store.get_full_path_fn()("c") == f"{uri}/c"
    assert store.fs is store.filesystem is store.get_filesystem()


def test_custom_paths_move_data_and_runs(tmp_path):
    store = LocalStore(str(tmp_path / "p"), train_path=str(tmp_path / "t"),
                       val_path=str(tmp_path / "v"), test_path=str(tmp_path / "te"),
                       runs_path=str(tmp_path / "r"), checkpoint_filename="ckpt.pt")
    assert store.get_train_data_path(3) == f"file://{tmp_path}/t.3"
    assert store.get_val_data_path() == f"file://{tmp_path}/v"
    assert store.get_test_data_path() == f"file://{tmp_path}/te"
    assert store.get_run_path("x") == f"file://{tmp_path}/r/x"
    assert store.get_checkpoint_filename() == "ckpt.pt"
    store.save_checkpoint("x", 1, b"one")
    assert (tmp_path / "r" / "x" / "checkpoints" / "epoch-000001.ckpt").read_bytes() == b"one"
    assert store.latest_checkpoint("x") == (1, b"one")
    # The writer's dataset cache follows train_path.
    assert store.path(store.dataset_path("k")) == f"{tmp_path}/t/k"
    clone = pickle.loads(pickle.dumps(store))
    assert clone == store and clone.get_run_path("x") == store.get_run_path("x")


def test_save_runs_false_keeps_no_checkpoints(tmp_path):
    store = Store.create(str(tmp_path), save_runs=False)
    assert store.saving_runs() is False
    assert store.get_checkpoint_path("r") is None and store.get_logs_path("r") is None
    assert store.save_checkpoint("r", 0, b"x") is None
    assert store.list_checkpoints("r") == [] and not (tmp_path / "runs").exists()


def test_exists_read_write_text_take_full_and_relative_paths(tmp_path):
    store = Store.create(str(tmp_path))
    full = store.get_logs_path("r") + "/note.txt"
    assert not store.exists(full)
    store.write_text(full, "héllo")
    assert (tmp_path / "runs" / "r" / "logs" / "note.txt").read_text("utf-8") == "héllo"
    assert store.exists(full) and store.exists("runs/r/logs/note.txt")
    assert store.exists(str(tmp_path / "runs" / "r"))  # a directory, by local path
    assert store.read(full) == "héllo".encode() == store.read("runs/r/logs/note.txt")
    with pytest.raises(FileNotFoundError):
        store.read(store.get_run_path("r") + "/missing")
    with pytest.raises(ConfigError, match="not on the filesystem"):
        store.exists("s3://bucket/x")


def test_checkpoints_listing_by_full_path(tmp_path):
    store = Store.create(str(tmp_path))
    for epoch in (0, 4):
        store.save_checkpoint("run", epoch, b"c")
    store.write_text(store.get_checkpoint_path("run") + "/other.txt", "x")
    assert store.get_checkpoints("run") == [
        f"file://{tmp_path}/runs/run/checkpoints/epoch-000000.ckpt",
        f"file://{tmp_path}/runs/run/checkpoints/epoch-000004.ckpt",
    ]
    assert store.get_checkpoints("run", suffix=".txt") == [
        f"file://{tmp_path}/runs/run/checkpoints/other.txt"]


def test_parquet_dataset_checks(tmp_path):
    store = Store.create(str(tmp_path))
    data = tmp_path / "intermediate_train_data.0"
    data.mkdir()
    assert not store.is_parquet_dataset(store.get_train_data_path(0))  # empty directory
    pq.write_table(pa.table({"x": [1, 2, 3]}), data / "part-0.parquet")
    pq.write_table(pa.table({"x": [4]}), data / "part-1.parquet")
    (data / "_SUCCESS").write_bytes(b"")
    (data / "_hvd_spark_spec.json").write_text("{}")
    path = store.get_train_data_path(0)
    assert store.is_parquet_dataset(path)
    dataset = store.get_parquet_dataset(path)
    assert dataset.count_rows() == 4 and dataset.schema.names == ["x"]
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.parquet").write_bytes(b"not parquet at all")
    assert not store.is_parquet_dataset("junk")
    assert not store.is_parquet_dataset("missing")


def test_sync_fn_uploads_new_and_changed_files(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    local = tmp_path / "local"
    (local / "logs").mkdir(parents=True)
    (local / "logs" / "events").write_text("1")
    (local / "checkpoint").write_text("a")
    sync = pickle.loads(pickle.dumps(store.sync_fn("r")))  # runs where it is shipped
    sync(str(local))
    run = tmp_path / "store" / "runs" / "r"
    assert (run / "logs" / "events").read_text() == "1" and (run / "checkpoint").read_text() == "a"
    (run / "checkpoint").write_text("remote edit")  # unchanged locally: not uploaded again
    time.sleep(0.01)
    (local / "logs" / "events").write_text("12")
    os.utime(local / "logs" / "events", ns=(time.time_ns(), time.time_ns() + 10**9))
    sync(str(local))
    assert (run / "logs" / "events").read_text() == "12"
    assert (run / "checkpoint").read_text() == "remote edit"
    with pytest.raises(ConfigError, match="local directory"):
        sync(str(tmp_path / "nope"))


def test_copy_uploads_a_file_or_a_directory_tree(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    local = tmp_path / "local"
    (local / "sub").mkdir(parents=True)
    (local / "a.txt").write_text("a")
    (local / "sub" / "b.txt").write_text("b")
    store.copy(str(local / "a.txt"), store.get_run_path("r") + "/one.txt")
    assert store.read("runs/r/one.txt") == b"a"
    store.copy(str(local), "runs/r/tree", recursive=True)
    assert store.read("runs/r/tree/a.txt") == b"a" and store.read("runs/r/tree/sub/b.txt") == b"b"
    with pytest.raises(ConfigError, match="pass recursive=True"):
        store.copy(str(local), "runs/r/x")
    with pytest.raises(ConfigError, match="existing local file"):
        store.copy(str(tmp_path / "missing"), "runs/r/x")


def test_local_output_dir_and_to_remote(tmp_path):
    store = Store.create(str(tmp_path))
    with store.get_local_output_dir_fn("r")() as out:
        assert os.path.isdir(out)
    assert not os.path.exists(out)
    remote = store.to_remote("r", 1)
    assert remote.train_data_path == store.get_train_data_path(1)
    assert remote.checkpoint_path == store.get_checkpoint_path("r")
    assert remote.saving_runs is True and remote.logs_subdir == "logs"
    assert callable(remote.sync) and callable(remote.get_local_output_dir)


def test_create_dispatch(tmp_path):
    assert type(Store.create(str(tmp_path))) is LocalStore
    assert type(Store.create(f"file://{tmp_path}")) is LocalStore
    assert type(Store.create(f"file:{tmp_path}")) is LocalStore
    assert type(Store.create("hdfs://nn:8020/user/x")) is HDFSStore
    for url in ("dbfs:/ml/x", "/dbfs/ml/x", "file:/dbfs/ml/x", "file:///dbfs/ml/x"):
        store = Store.create(url)
        assert type(store) is DBFSLocalStore and store.url == "/dbfs/ml/x", url
    for url in ("s3://bkt/p", "s3a://bkt/p", "gs://bkt/p"):
        assert type(Store.create(url)) is FilesystemStore, url
    store = Store.create(str(tmp_path), None, None, None, str(tmp_path / "runs2"))
    assert store.get_runs_path() == f"file://{tmp_path}/runs2"  # positional args pass on
    assert Store.create(store) is store
    with pytest.raises(ConfigError, match="non-empty path or URL"):
        Store.create("")


def test_s3a_store_keeps_its_scheme_in_paths():
    store = Store.create("s3a://bkt/pfx?endpoint_override=127.0.0.1:9&scheme=http")
    assert store.get_train_data_path(1) == "s3a://bkt/pfx/intermediate_train_data.1"
    assert store.get_run_path("r") == "s3a://bkt/pfx/runs/r"
    assert store.get_localized_path(store.get_run_path("r")) == "bkt/pfx/runs/r"
    assert store.get_localized_path("s3://bkt/pfx/a") == "bkt/pfx/a"
    assert store.get_full_path("/other/key") == "s3a://bkt/other/key"
    assert store.filesystem.type_name == "s3" and store.path("a") == "bkt/pfx/a"


def test_hdfs_store_construction_only():
    store = HDFSStore("hdfs://nn:8020/user/test/hvd", user="bob", kerb_ticket="/tmp/krb",
                      extra_conf={"dfs.replication": "1"}, driver="libhdfs3")
    assert store.get_train_data_path(0) == "hdfs://nn:8020/user/test/hvd/intermediate_train_data.0"
    assert store.get_localized_path(store.get_run_path("r")) == "/user/test/hvd/runs/r"
    assert store.get_full_path("/abs/path") == "hdfs://nn:8020/abs/path"
    assert store._options == {"user": "bob", "kerb_ticket": "/tmp/krb",
                              "extra_conf": {"dfs.replication": "1"}}
    bare = HDFSStore("/user/test/hvd", host="nn2", port=9000)
    assert bare.url == "hdfs:///user/test/hvd"
    assert bare.get_run_path("r") == "hdfs:///user/test/hvd/runs/r"
    assert bare._options == {"host": "nn2", "port": 9000}
    clone = pickle.loads(pickle.dumps(bare))
    assert clone == bare and clone._options == bare._options
    with pytest.raises(ConfigError, match="HDFSStore needs an hdfs://"):
        HDFSStore("s3://bkt/x")
    with pytest.raises(ConfigError, match="needs a path after the namenode"):
        HDFSStore("hdfs://nn:8020/")


def test_dbfs_store_maps_to_the_fuse_mount():
    store = DBFSLocalStore("dbfs:/ml/exp")
    assert store.url == "/dbfs/ml/exp"
    assert store.get_train_data_path() == "file:///dbfs/ml/exp/intermediate_train_data"
    assert store.get_localized_path("dbfs:/ml/exp/runs/r") == "/dbfs/ml/exp/runs/r"
    assert store.get_checkpoint_filename() == "checkpoint.tf"
    assert DBFSLocalStore.matches_dbfs("dbfs:/x") and not DBFSLocalStore.matches_dbfs("/tmp/x")
    assert DBFSLocalStore.normalize_path("file:///dbfs/a") == "/dbfs/a"
    with pytest.raises(ConfigError, match="not a DBFS path"):
        DBFSLocalStore("/tmp/not-dbfs")


def test_bad_arguments_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="storage_options must be a dict"):
        Store.create(str(tmp_path), storage_options="key=x")
    with pytest.raises(ConfigError, match="run_id must be"):
        Store.create(str(tmp_path)).get_run_path("a/b")
    # Unknown Horovod keywords are accepted (a working Horovod script never fails here).
    assert Store.create(str(tmp_path), unknown_horovod_option=1).url == str(tmp_path)
