"""ShardReader: disjoint/complete sharding, equal steps, seeded shuffles, prefetch errors."""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_spark.data.prefetch import Prefetcher
from hvd_spark.data.reader import ShardReader, table_to_numpy
from hvd_spark.data.spec import ColumnSpec, DatasetSpec, SplitSpec
from hvd_spark.errors import ConfigError, DataError

N = 120


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """N rows over 4 files of unequal size, several row groups each; id = row number."""
    root = tmp_path_factory.mktemp("parquet")
    paths, start = [], 0
    for i, n in enumerate((50, 7, 33, 30)):
        ids = np.arange(start, start + n, dtype=np.int64)
        table = pa.table({
            "id": ids,
            "x": ids.astype(np.float32) * 2,
            "vec": pa.array([[float(j), -float(j)] for j in ids], pa.list_(pa.float32())),
        })
        path = str(root / f"part-{i}.parquet")
        pq.write_table(table, path, row_group_size=9)
        paths.append(path)
        start += n
    return paths


def ids_of(reader, epoch):
    return [batch["id"].tolist() for batch in reader.epoch(epoch)]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_are_disjoint_complete_and_equal_steps(files, size, shuffle):
    batch = 4
    readers = [ShardReader(files, r, size, batch, shuffle=shuffle, seed=3,
                           shuffle_buffer_size=16) for r in range(size)]
    steps = {len(r) for r in readers}
    assert steps == {(N // size) // batch}
    for epoch in (0, 1):
        # The plans split all N rows between the ranks, without overlap.
        planned = [i for reader in readers for piece in reader.shard_plan(epoch)
                   for i in reader._read_piece(*piece)["id"].tolist()]
        assert sorted(planned) == list(range(N))
        # Every rank yields exactly `steps` full batches of distinct rows.
        seen = []
        for reader in readers:
            batches = ids_of(reader, epoch)
            assert len(batches) == len(reader)
            assert all(len(b) == batch for b in batches)
            seen += [i for b in batches for i in b]
        assert len(seen) == len(set(seen)) == size * len(readers[0]) * batch
        assert set(seen) <= set(range(N))


def test_no_shuffle_single_rank_reads_everything_in_order(files):
    reader = ShardReader(files, 0, 1, 8, shuffle=False)
    assert [i for b in ids_of(reader, 0) for i in b] == list(range(N))


def test_shuffle_is_seeded_and_differs_by_epoch(files):
    a = ShardReader(files, 1, 2, 5, seed=7)
    b = ShardReader(files, 1, 2, 5, seed=7)
    c = ShardReader(files, 1, 2, 5, seed=8)
    assert ids_of(a, 0) == ids_of(b, 0)
    assert ids_of(a, 0) != ids_of(a, 1)
    assert ids_of(a, 0) != ids_of(c, 0)
    assert sorted(sum(ids_of(a, 0), [])) != sum(ids_of(a, 0), [])  # rows really are mixed


def test_batches_have_spec_shapes_and_values(files):
    root = os.path.dirname(files[0])
    spec = DatasetSpec(
        key="k", root_url=root, feature_cols=("x", "vec"), label_cols=("id",),
        columns=(ColumnSpec("x", "float32"), ColumnSpec("vec", "float32", (2,), "vector"),
                 ColumnSpec("id", "int64")),
        train=SplitSpec(tuple(os.path.basename(p) for p in files), N, ()),
    )
    reader = ShardReader(spec, 0, 2, 6, seed=1)
    info = reader.column_info()
    assert info["vec"] == ((2,), np.dtype("float32")) and info["id"] == ((), np.dtype("int64"))
    for batch in reader.epoch(0):
        assert batch["vec"].shape == (6, 2) and batch["x"].dtype == np.float32
        np.testing.assert_array_equal(batch["x"], batch["id"] * 2)
        np.testing.assert_array_equal(batch["vec"][:, 0], batch["id"])
        np.testing.assert_array_equal(batch["vec"][:, 1], -batch["id"])


def test_steps_per_epoch_beyond_the_data_reads_it_again(files):
    reader = ShardReader(files, 0, 2, 10, steps_per_epoch=9, seed=2)
    batches = ids_of(reader, 0)
    assert len(batches) == 9 and all(len(b) == 10 for b in batches)


def test_bad_arguments(files):
    with pytest.raises(ConfigError, match=r"rank must be an int in \[0, size=2\)"):
        ShardReader(files, 2, 2, 4)
    with pytest.raises(ConfigError, match="batch_size must be an int >= 1"):
        ShardReader(files, 0, 1, 0)
    with pytest.raises(ConfigError, match=r"column\(s\) \['nope'\] not in the Parquet files"):
        ShardReader(files, 0, 1, 4, columns=["nope"])
    with pytest.raises(DataError, match="fewer than size x batch_size = 4 x 40"):
        ShardReader(files, 0, 4, 40)


def test_unequal_arrays_and_nulls_are_data_errors():
    table = pa.table({"a": pa.array([[1.0], [1.0, 2.0]]), "b": pa.array([1.0, None])})
    with pytest.raises(DataError, match="'a' has arrays of unequal length"):
        table_to_numpy(table, ["a"], {"a": None})
    with pytest.raises(DataError, match="'b' has 1 null value"):
        table_to_numpy(table, ["b"], {"b": ()})


def test_read_errors_reach_the_consumer(files, tmp_path):
    path = tmp_path / "one.parquet"
    pq.write_table(pa.table({"id": np.arange(40)}), str(path), row_group_size=10)
    reader = ShardReader([str(path)], 0, 1, 4, shuffle=False)
    path.write_bytes(b"not parquet any more")
    with pytest.raises((OSError, pa.ArrowException)):
        list(reader.epoch(0))


def test_prefetcher_propagates_errors_and_times_out():
    def failing():
        yield 1
        yield 2
        raise ValueError("disk on fire")

    it = Prefetcher(failing(), 1, 5.0, "t")
    assert next(it) == 1 and next(it) == 2
    with pytest.raises(ValueError, match="disk on fire"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)

    def slow():
        time.sleep(1.0)
        yield 1

    with pytest.raises(DataError, match="no batch arrived within 0 s"):
        next(Prefetcher(slow(), 1, 0.2, "slow"))


def test_prefetcher_stops_its_thread_when_closed():
    def endless():
        i = 0
        while True:
            yield i
            i += 1

    it = Prefetcher(endless(), 2, 5.0, "endless")
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    it.close()
    assert not it._thread.is_alive()


def test_abandoned_epoch_iterator_stops_its_thread(files):
    import gc
    import threading

    reader = ShardReader(files, 0, 1, 2, prefetch_batches=1)
    it = reader.epoch(0)
    next(it)
    thread = it._thread
    del it
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("hvd_spark-decode")]


def test_default_shuffle_buffer_is_bounded_in_bytes(files):
    from hvd_spark.data.reader import default_shuffle_buffer

    assert default_shuffle_buffer(400, 32) == 10_000  # 100 float32 columns: 4 MB
    assert default_shuffle_buffer(224 * 224 * 3 * 4, 32) == 445  # images: 256 MiB at most
    assert default_shuffle_buffer(64 << 20, 8) == 8  # never less than one batch
    reader = ShardReader(files, 0, 1, 4)
    # id int64 + x float32 + vec 2 x float32 (shape inferred from the first row).
    assert reader.row_bytes() == 8 + 4 + 8 and reader.shuffle_buffer_size == 10_000
    assert ShardReader(files, 0, 1, 4, shuffle_buffer_size=0).shuffle_buffer_size == 0
