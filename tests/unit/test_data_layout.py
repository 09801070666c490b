"""The stored Parquet layout: packed arrays round-trip, and the reader unpacks them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_spark.data import ShardReader
from hvd_spark.data.layout import (
    ROW_GROUP_BYTES,
    dictionary_columns,
    pack_arrays,
    row_group_rows,
    storage_schema,
    unpack,
)
from hvd_spark.data.spec import ColumnSpec, DatasetSpec, SplitSpec
from hvd_spark.errors import ConfigError, DataError

SPECS = [ColumnSpec("id", "int64"), ColumnSpec("vec", "float32", (3,), "vector"),
         ColumnSpec("arr", "float64", (2,), "array")]


def _table(ids: np.ndarray) -> pa.Table:
    return pa.table({
        "id": ids,
        "vec": pa.array([[i, -i, 0.5 * i] for i in ids.tolist()], pa.list_(pa.float32())),
        "arr": pa.array([[i / 3, i * 1e300] for i in ids.tolist()], pa.list_(pa.float64())),
    })


def test_pack_unpack_round_trip_with_slices_and_empty():
    packed = pack_arrays(_table(np.arange(10)), SPECS)
    assert packed.schema.field("vec").type == pa.binary(12)
    assert packed.schema.field("arr").type == pa.binary(16)
    part = packed.slice(3, 4)  # a non-zero offset into the buffers
    vec = unpack(part.column("vec").chunk(0), "vec", np.dtype("float32"), (3,))
    arr = unpack(part.column("arr").chunk(0), "arr", np.dtype("float64"), (2,))
    ids = np.arange(3, 7)
    np.testing.assert_array_equal(vec, np.stack([ids, -ids, 0.5 * ids], 1).astype(np.float32))
    np.testing.assert_array_equal(arr, np.stack([ids / 3, ids * 1e300], 1))
    assert not vec.flags.writeable  # a view of Arrow's buffer, no copy
    empty = unpack(packed.slice(0, 0).column("vec").chunk(0), "vec", np.dtype("float32"), (3,))
    assert empty.shape == (0, 3)
    with pytest.raises(DataError, match="'vec' holds 12-byte values, not arrays of shape"):
        unpack(part.column("vec").chunk(0), "vec", np.dtype("float64"), (3,))


def test_storage_schema_and_dictionary_choice():
    schema = storage_schema(pack_arrays(_table(np.arange(4)), SPECS).schema)
    assert not any(f.nullable for f in schema)
    lists = pa.schema([("f", pa.float32()), ("i", pa.list_(pa.int32())), ("b", pa.bool_()),
                       ("p", pa.binary(8)), ("d", pa.list_(pa.float64()))])
    assert dictionary_columns(lists) == ["i.list.element", "b"]
    with pytest.raises(ValueError, match="null values to non-nullable"):
        pa.table({"x": [1, None]}).cast(storage_schema(pa.schema([("x", pa.int64())])))


def test_reader_unpacks_shuffled_batches_through_the_spec(tmp_path):
    files, counts = [], []
    for i, (start, n) in enumerate(((0, 37), (37, 27))):
        table = pack_arrays(_table(np.arange(start, start + n)), SPECS)
        table = table.cast(storage_schema(table.schema))
        pq.write_table(table, tmp_path / f"p{i}.parquet", row_group_size=10)
        files.append(f"p{i}.parquet")
        counts.append(n)
    spec = DatasetSpec(key="k", root_url=str(tmp_path), columns=tuple(SPECS),
                       feature_cols=("vec", "arr"), label_cols=("id",),
                       train=SplitSpec(tuple(files), sum(counts), tuple(counts)))
    seen = []
    for rank in range(2):
        reader = ShardReader(spec, rank, 2, 4, seed=5, shuffle_buffer_size=12)
        assert reader.column_info()["arr"] == ((2,), np.dtype("float64"))
        for batch in reader.epoch(1):
            ids = batch["id"]
            assert batch["vec"].shape == (4, 3) and batch["arr"].dtype == np.float64
            np.testing.assert_array_equal(batch["vec"][:, 1], -ids.astype(np.float32))
            np.testing.assert_array_equal(batch["arr"][:, 0], ids / 3)
            seen += ids.tolist()
    assert len(seen) == len(set(seen)) == 64 and seen != sorted(seen)
    # Without the spec, a packed column's dtype and shape are unknown: a clear error.
    with pytest.raises(ConfigError, match="'vec' holds packed arrays.*DatasetSpec"):
        ShardReader([str(tmp_path / f) for f in files], 0, 1, 4)


def test_row_groups_are_bounded_in_bytes():
    narrow = pa.table({"x": np.zeros(10_000, np.float32)})
    assert row_group_rows(narrow) == 10_000
    # 150,528 float32 per row (a 224x224x3 image) packed: about 600 KB a row.
    image = pack_arrays(pa.table({"img": pa.array([np.zeros(150_528, np.float32)] * 200)}),
                        [ColumnSpec("img", "float32", (150_528,), "array")])
    rows = row_group_rows(image)
    assert rows == ROW_GROUP_BYTES // (150_528 * 4) == 111
    assert row_group_rows(image.slice(0, 0)) == 1
