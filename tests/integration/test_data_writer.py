"""write_dataset on real local Spark: types, validation splits, cache, every bad input."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest

from hvd_spark.data import ShardReader, Store, write_dataset
from hvd_spark.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def df(spark):
    from pyspark.ml.linalg import Vectors

    rows = [
        (i, float(i) / 2, [i, -i, 2 * i],
         Vectors.dense([float(i), 1.0]) if i % 2 else Vectors.sparse(2, {0: float(i)}),
         i % 3, int(i % 4 == 0), i % 4 == 0)
        for i in range(64)
    ]
    return spark.createDataFrame(rows, ["id", "x", "arr", "vec", "y", "is_val", "is_val_b"])


def fit(df, store, **kw):
    args = dict(feature_cols=["id", "x", "arr", "vec"], label_cols="y", num_proc=2, batch_size=4)
    args.update(kw)
    return write_dataset(df, store, **args)


def mtimes(store, spec):
    base = store.path(store.dataset_path(spec.key))
    files = [*spec.train.files, *spec.val.files, "spec.json"]
    return {f: os.stat(os.path.join(base, f)).st_mtime_ns for f in files}


@pytest.mark.smoke
def test_types_validation_column_cache_and_read_back(df, tmp_path):
    store = Store.create(str(tmp_path))
    spec = fit(df, store, validation="is_val", partitions_per_process=2)
    cols = {c.name: c for c in spec.columns}
    assert (cols["arr"].kind, cols["arr"].shape, cols["arr"].dtype) == ("array", (3,), "int64")
    assert (cols["vec"].kind, cols["vec"].shape, cols["vec"].dtype) == ("vector", (2,), "float32")
    assert (cols["x"].shape, cols["x"].dtype, cols["id"].dtype) == ((), "float64", "int64")
    assert (spec.train.num_rows, spec.val.num_rows) == (48, 16)
    assert len(spec.train.files) <= 4 and sum(spec.train.file_rows) == 48
    assert store.exists(store.spec_path(spec.key))

    # Read every training row back through the reader (2 ranks), values intact.
    seen = []
    for rank in range(2):
        for batch in ShardReader(spec, rank, 2, 4, shuffle=False).epoch(0):
            ids = batch["id"]
            assert not np.any(ids % 4 == 0)
            np.testing.assert_array_equal(batch["arr"], np.stack([ids, -ids, 2 * ids], axis=1))
            odd = ids % 2 == 1
            np.testing.assert_array_equal(batch["vec"][:, 0], ids.astype(np.float32))
            np.testing.assert_array_equal(batch["vec"][:, 1], odd.astype(np.float32))
            np.testing.assert_array_equal(batch["y"], ids % 3)
            seen += ids.tolist()
    assert sorted(seen) == [i for i in range(64) if i % 4]
    val_ids = [i for b in ShardReader(spec, 0, 1, 4, split="val").epoch(0) for i in b["id"]]
    assert sorted(val_ids) == list(range(0, 64, 4))

    # The stored layout (hvd_spark.data.layout): required columns; arrays and vectors packed
    # as fixed-size binary (3 int64 = 24 bytes, 2 float32 = 8 bytes); a dictionary only for
    # the integer scalars.
    base = store.path(store.dataset_path(spec.key))
    stored = pq.read_schema(os.path.join(base, spec.train.files[0]))
    assert not any(f.nullable for f in stored), stored
    assert stored.field("arr").type == pa.binary(24) and stored.field("vec").type == pa.binary(8)
    meta = pq.read_metadata(os.path.join(base, spec.train.files[0])).row_group(0)
    encodings = {meta.column(i).path_in_schema: meta.column(i).encodings
                 for i in range(meta.num_columns)}
    dictionary = {path for path, enc in encodings.items() if "RLE_DICTIONARY" in enc}
    assert dictionary == {"id", "y"}, encodings

    # Same data and settings: reused, nothing rewritten. A boolean column gives the same split.
    before = mtimes(store, spec)
    assert fit(df, store, validation="is_val", partitions_per_process=2) == spec
    assert mtimes(store, spec) == before
    by_bool = fit(df, store, validation="is_val_b", partitions_per_process=2)
    assert (by_bool.train.num_rows, by_bool.val.num_rows) == (48, 16)

    # Other settings or other data: new keys, both kept.
    other = fit(df, store, validation="is_val", partitions_per_process=1)
    changed = fit(df.where("id < 63"), store, validation="is_val", partitions_per_process=2)
    assert len({spec.key, other.key, changed.key, by_bool.key}) == 4
    assert changed.train.num_rows == 47

    # A half-written dataset (no spec.json, the commit marker) is rewritten, not reused.
    store.delete(store.spec_path(spec.key))
    again = fit(df, store, validation="is_val", partitions_per_process=2)
    assert again.key == spec.key and store.exists(store.spec_path(spec.key))


def test_validation_fraction_is_seeded(df, tmp_path):
    store = Store.create(str(tmp_path))
    a = fit(df, store, validation=0.25, seed=1)
    b = fit(df, store, validation=0.25, seed=2)
    assert a.key != b.key
    assert a.train.num_rows + a.val.num_rows == 64 and 4 <= a.val.num_rows <= 28
    none = fit(df, store)
    assert (none.train.num_rows, none.val.num_rows, none.val.files) == (64, 0, ())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(feature_cols=["nope"]), DataError,
         r"column 'nope' not found in the DataFrame; available columns: id, x, name, st"),
        (dict(label_cols="name"), DataError, r"column 'name' has type string"),
        (dict(label_cols="st"), DataError, r"column 'st' has type struct<"),
        (dict(validation="name"), DataError, r"validation column 'name' has type string"),
        (dict(validation=1.5), ConfigError, r"validation must be None, a float fraction"),
        (dict(num_proc=0), ConfigError, r"num_proc must be an int >= 1"),
        (dict(feature_cols=[]), ConfigError, r"feature_cols must name at least one column"),
    ],
)
def test_bad_settings_and_schema_fail_before_any_job(spark, tmp_path, kwargs, error, match):
    df = spark.createDataFrame([(1, 1.0, "a", (1, 2))], "id long, x double, name string, "
                               "st struct<a:int,b:int>")
    args = dict(feature_cols=["id", "x"], num_proc=1, batch_size=1)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        write_dataset(df, str(tmp_path), **args)
    assert not os.path.exists(tmp_path / "intermediate_train_data")


@pytest.mark.parametrize(
    ("rows", "kwargs", "match"),
    [
        ([], {}, "the DataFrame is empty"),
        ([(1, None, [1.0], 0)] + [(i, 1.0, [1.0], 0) for i in range(2, 9)], {},
         r"null values in column\(s\) 'x' \(1 rows\)"),
        ([(1, 1.0, [1.0, 2.0], 0)] + [(i, 1.0, [1.0], 0) for i in range(2, 9)], {},
         r"column 'arr' has arrays of unequal length \(1 to 2\)"),
        ([(1, 1.0, [1.0, None], 0)] + [(i, 1.0, [1.0, 2.0], 0) for i in range(2, 9)], {},
         r"column 'arr' has null elements"),
        ([(1, float("nan"), [1.0], 0)] + [(i, 1.0, [1.0], 0) for i in range(2, 9)], {},
         r"NaN or infinite values in column\(s\) 'x' \(1 rows\)"),
        ([(1, 1.0, [1.0, float("-inf")], 0), (2, 1.0, [float("nan"), 1.0], 0)]
         + [(i, 1.0, [1.0, 2.0], 0) for i in range(3, 9)], {},
         r"NaN or infinite values in column\(s\) 'arr' \(2 rows\)"),
        ([(i, 1.0, [1.0], i % 3) for i in range(9)], {"validation": "v"},
         r"validation column 'v' has 3 row\(s\) that are not 0/1 \(null, or values from 2.0"),
        ([(i, 1.0, [1.0], 0) for i in range(7)], {},
         r"7 training rows are fewer than num_proc x batch_size = 2 x 4"),
        ([(i, 1.0, [1.0], int(i == 0)) for i in range(9)], {"validation": "v"},
         r"1 validation rows are fewer than num_proc x val_batch_size = 2 x 4"),
    ],
)
def test_bad_data_fails_before_writing(spark, tmp_path, rows, kwargs, match):
    df = spark.createDataFrame(rows, "id long, x double, arr array<double>, v int")
    with pytest.raises(DataError, match=match):
        write_dataset(df, str(tmp_path), feature_cols=["x", "arr"], label_cols="id", num_proc=2,
                     batch_size=4, **kwargs)
    assert not os.path.exists(tmp_path / "intermediate_train_data")
