"""Horovod's ``prepare_data`` context manager on real local[2] Spark, real Parquet files.

Written as a Horovod user writes it (``util.prepare_data(num_proc, store, df, ...)``),
read back through Spark, pyarrow and the package's reader.
"""

from __future__ import annotations

import os

import numpy as np
import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest

from hvd_spark.data import ShardReader, Store
from hvd_spark.data import dataset_index as util
from hvd_spark.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def frames(spark):
    from pyspark.ml.linalg import Vectors

    def make(offset: int):
        rows = [(i, Vectors.dense([float(i), -float(i), 1.0]), float(i % 2), int(i % 4 == 0))
                for i in range(offset, offset + 80)]
        return spark.createDataFrame(rows, ["id", "features", "label", "is_val"])

    return make(0), make(1000), make(2000)


@pytest.fixture(autouse=True)
def fresh_index():
    util.clear_training_cache()
    yield
    util.clear_training_cache()


def _files_mtime(path: str) -> dict[str, int]:
    return {f: os.stat(os.path.join(path, f)).st_mtime_ns for f in sorted(os.listdir(path))}


def test_prepare_data_writes_parquet_at_the_index_paths(spark, frames, tmp_path):
    df = frames[0]
    store = Store.create(str(tmp_path / "store"))
    with util.prepare_data(2, store, df, label_columns=["label"], feature_columns=["features"],
                           validation="is_val", partitions_per_process=2) as idx:
        assert idx == 0
        train, val = store.get_train_data_path(idx), store.get_val_data_path(idx)
        assert train == f"file://{tmp_path}/store/intermediate_train_data.0"
        assert store.is_parquet_dataset(train) and store.is_parquet_dataset(val)
        # Spark reads the files Horovod-style (the spec file starts with "_": skipped).
        assert spark.read.parquet(train).count() == 60
        assert spark.read.parquet(val).count() == 20
        assert store.get_parquet_dataset(val).count_rows() == 20
        rows, val_rows, metadata, row_size = util.get_dataset_properties(idx)
        assert (rows, val_rows) == (60, 20)
        assert metadata["features"] == {"dtype": "float32", "shape": (3,), "kind": "vector"}
        assert row_size == 3 * 4 + 8  # float32 x 3 + the float64 label
        spec = util.load_dataset_spec(store, idx)
        assert spec.feature_cols == ("features",) and spec.label_cols == ("label",)
        seen = []
        for split in ("train", "val"):
            for batch in ShardReader(spec, 0, 1, 4, split=split, shuffle=False).epoch(0):
                ids = batch["features"][:, 0].astype(int)
                np.testing.assert_array_equal(batch["features"][:, 1], -ids)
                np.testing.assert_array_equal(batch["label"], ids % 2)
                assert np.all((ids % 4 == 0) == (split == "val"))
                seen += ids.tolist()
        assert sorted(seen) == list(range(80))


def test_indices_are_reserved_while_used_and_reused_after(frames, tmp_path):
    a, b, c = frames
    store = Store.create(str(tmp_path))
    args = dict(label_columns=["label"], feature_columns=["features", "id"], validation=0.2)
    with util.prepare_data(2, store, a, **args) as first:
        train0 = store.get_localized_path(store.get_train_data_path(first))
        before = _files_mtime(train0)
        with util.prepare_data(2, store, b, **args) as second:
            assert (first, second) == (0, 1)  # 0 is in use: b gets the next index
        with util.prepare_data(2, store, a, **args) as again:
            assert again == 0 and _files_mtime(train0) == before  # same data: files reused
    with util.prepare_data(2, store, c, **args) as third:
        assert third == 0  # free again: c takes it and replaces a's files
        spec = util.load_dataset_spec(store, third)
        ids = ShardReader(spec, 0, 1, 1, shuffle=False, columns=["id"]).epoch(0)
        assert min(int(batch["id"][0]) for batch in ids) >= 2000
        assert _files_mtime(train0) != before


def test_default_feature_columns_and_no_validation(frames, tmp_path):
    store = Store.create(str(tmp_path))
    with util.prepare_data(1, store, frames[0], label_columns=["label"], validation=0.0) as idx:
        spec = util.load_dataset_spec(store, idx)
        assert spec.feature_cols == ("id", "features", "is_val")
        assert (spec.train.num_rows, spec.val.num_rows) == (80, 0)
        assert not store.exists(store.get_val_data_path(idx))


def test_custom_train_and_val_paths_outside_the_prefix(frames, tmp_path):
    store = Store.create(str(tmp_path / "p"), train_path=str(tmp_path / "data" / "train"),
                         val_path=str(tmp_path / "other" / "val"))
    with util.prepare_data(2, store, frames[1], label_columns=["label"],
                           validation="is_val") as idx:
        assert sorted(os.listdir(tmp_path)) == ["data", "other"]  # nothing under the prefix
        assert store.is_parquet_dataset(str(tmp_path / "data" / "train.0"))
        assert store.is_parquet_dataset(str(tmp_path / "other" / "val.0"))
        spec = util.load_dataset_spec(store, idx)
        rows = {split: sum(len(b["id"]) for b in ShardReader(spec, 0, 1, 1, split=split,
                                                              columns=["id"]).epoch(0))
                for split in ("train", "val")}
        assert rows == {"train": 60, "val": 20}


def test_bad_input(frames, tmp_path):
    df = frames[0]
    store = str(tmp_path)
    with pytest.raises(ConfigError, match="label_columns must name at least one column"):
        with util.prepare_data(2, store, df):
            pass
    with pytest.raises(ConfigError, match="num_processes must be an int >= 1"):
        with util.prepare_data(0, store, df, label_columns=["label"]):
            pass
    with pytest.raises(DataError, match="column 'nope' not found"):
        with util.prepare_data(2, store, df, label_columns=["nope"]):
            pass
    with pytest.raises(DataError, match="validation column 'v' not found"):
        with util.prepare_data(2, store, df, label_columns=["label"], validation="v"):
            pass
    with pytest.raises(DataError, match="no dataset 7"):
        util.load_dataset_spec(store, 7)
    with pytest.raises(DataError, match="was not prepared in this process"):
        util.get_dataset_properties(7)


def test_spec_from_parquet_the_user_wrote(spark, frames, tmp_path):
    from pyspark.ml.functions import vector_to_array

    from hvd_spark.data.parquet_spec import spec_from_parquet

    df = frames[0].withColumn("arr", vector_to_array("features", "float32"))
    store = Store.create(str(tmp_path))
    train, val = df.filter("is_val = 0"), df.filter("is_val = 1")
    train.write.parquet(store.get_train_data_path())  # as Horovod users do
    val.write.parquet(store.get_val_data_path())
    spec = spec_from_parquet(store, ["arr", "id"], ["label"])
    cols = {c.name: c for c in spec.columns}
    assert (cols["arr"].kind, cols["arr"].shape, cols["arr"].dtype) == ("array", (3,), "float32")
    assert (cols["id"].dtype, cols["label"].dtype) == ("int64", "float64")
    assert (spec.train.num_rows, spec.val.num_rows) == (60, 20)
    for split, expect_val in (("train", False), ("val", True)):
        ids = []
        for batch in ShardReader(spec, 0, 1, 5, split=split, shuffle=False).epoch(0):
            np.testing.assert_array_equal(batch["arr"][:, 0], batch["id"])
            ids += batch["id"].tolist()
        assert all((i % 4 == 0) == expect_val for i in ids) and ids
    only_train = spec_from_parquet(store, ["id"], ["label"], val_path=None,
                                   train_path=store.get_train_data_path())
    assert only_train.train.num_rows == 60
    with pytest.raises(DataError, match="column 'features' has Parquet type struct"):
        spec_from_parquet(store, ["features"], ["label"])  # a Vector, stored as a struct
    with pytest.raises(DataError, match=r"column\(s\) \['nope'\] not in the Parquet files"):
        spec_from_parquet(store, ["nope"])
    with pytest.raises(DataError, match="no readable Parquet files"):
        spec_from_parquet(Store.create(str(tmp_path / "empty")), ["id"])
