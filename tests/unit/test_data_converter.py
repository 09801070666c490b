"""Converter's shard/step arithmetic, dtypes, epochs and errors, on Parquet files (no Spark)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_spark.data import Converter, Store
from hvd_spark.data.converter import _resolve_store
from hvd_spark.data.converter_loaders import BatchStream, resolve_shard, target_dtype
from hvd_spark.data.spec import ColumnSpec, DatasetSpec, SplitSpec
from hvd_spark.errors import ConfigError, DataError

ROWS = 53  # odd on purpose: shards of 26 and 27 rows


@pytest.fixture
def converter(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    key = "k" * 24
    directory = store.get_localized_path(store.data_path(key, "train"))
    os.makedirs(directory)
    files = []
    for i, (lo, hi) in enumerate(((0, 20), (20, ROWS))):
        ids = np.arange(lo, hi)
        pq.write_table(pa.table({
            "x": pa.array([[float(j)] * 3 for j in ids], pa.list_(pa.float32())),
            "d": pa.array(ids * 0.5, pa.float64()),
            "y": pa.array(ids, pa.int32()),
        }), os.path.join(directory, f"part-{i}.parquet"), row_group_size=7)
        files.append(f"train/part-{i}.parquet")
    spec = DatasetSpec(
        key=key, root_url=store.url_of(store.dataset_path(key)),
        columns=(ColumnSpec("x", "float32", (3,), "array"), ColumnSpec("d", "float64"),
                 ColumnSpec("y", "int32")),
        feature_cols=("x", "d", "y"),
        train=SplitSpec(files=tuple(files), num_rows=ROWS, file_rows=(20, ROWS - 20)),
    )
    store.write_bytes(store.spec_path(key), spec.to_json().encode())
    return Converter(spec, store)


def _stream(conv: Converter, rank: int, size: int, batch_size: int, **kw) -> BatchStream:
    return conv._stream(batch_size, kw.pop("num_epochs", 1), kw.pop("shuffle", True), rank,
                        size, 0, None, None, None)


@pytest.mark.parametrize("size,batch_size", [(2, 4), (3, 5), (2, 26), (4, 1)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_equal_steps_and_each_row_at_most_once(converter, size, batch_size, shuffle):
    expected = (ROWS // size) // batch_size
    steps = {_stream(converter, r, size, batch_size).steps_per_epoch for r in range(size)}
    assert steps == {expected}  # the same on every rank
    seen = []
    for rank in range(size):
        stream = _stream(converter, rank, size, batch_size, shuffle=shuffle)
        batches = list(stream)
        assert len(batches) == len(stream) == expected
        assert all(b["y"].shape == (batch_size,) for b in batches)
        seen += [int(v) for b in batches for v in b["y"]]
    assert len(seen) == len(set(seen))  # no row twice
    dropped = ROWS - len(seen)
    assert 0 <= dropped < size * (batch_size + 1)


def test_dtypes_ints_stay_ints_floats_become_float32(converter):
    batch = next(iter(_stream(converter, 0, 1, 8, shuffle=False)))
    assert batch["y"].dtype == np.int64 and batch["d"].dtype == np.float32
    assert batch["x"].dtype == np.float32 and batch["x"].shape == (8, 3)
    np.testing.assert_array_equal(batch["d"], batch["y"] * 0.5)
    keep = Converter(converter.spec, converter._store, dtype=None)
    assert next(iter(_stream(keep, 0, 1, 8)))["d"].dtype == np.float64
    assert target_dtype(np.dtype(np.int8), None) == np.int64
    assert target_dtype(np.dtype(bool), np.dtype(np.float32)) == np.bool_


def test_epochs_infinite_and_continuing(converter):
    stream = converter._stream(10, None, True, 0, 1, 0, None, None, None)
    with pytest.raises(TypeError, match="num_epochs=None"):
        len(stream)
    it = iter(stream)
    firsts = [next(it)["y"] for _ in range(3 * stream.steps_per_epoch)]
    assert len(firsts) == 15  # past the first epoch: never ends
    stream.close()
    assert list(it) == []  # closed: the iteration ends
    two = _stream(converter, 0, 1, 10, num_epochs=2)
    epoch_ab = [b["y"].tolist() for b in two]
    again = [b["y"].tolist() for b in two]  # a second pass reads the next epochs
    assert len(epoch_ab) == len(again) == 10 and epoch_ab != again


def test_resolve_shard(monkeypatch):
    monkeypatch.delenv("HVD_SPARK_RANK", raising=False)
    monkeypatch.delenv("HVD_SPARK_SIZE", raising=False)
    assert resolve_shard(None, None) == (0, 1)
    monkeypatch.setenv("HVD_SPARK_RANK", "1")
    monkeypatch.setenv("HVD_SPARK_SIZE", "3")
    assert resolve_shard(None, None) == (1, 3)
    assert resolve_shard(0, 2) == (0, 2)
    with pytest.raises(ConfigError, match="both cur_shard and shard_count"):
        resolve_shard(1, None)
    with pytest.raises(ConfigError, match="cur_shard must be < shard_count=2"):
        resolve_shard(2, 2)
    with pytest.raises(ConfigError, match="shard_count must be an int >= 1"):
        resolve_shard(0, 0)


def test_pickles_len_and_delete(converter):
    clone = pickle.loads(pickle.dumps(converter))
    assert len(clone) == clone.dataset_size == ROWS and clone.columns == ["x", "d", "y"]
    assert len(clone.file_urls) == 2
    with pytest.raises(ConfigError, match=r"column\(s\) \['nope'\] are not in the converter"):
        clone.make_torch_dataloader(columns=["nope"], cur_shard=0, shard_count=1)
    with pytest.raises(DataError, match="fewer than size x batch_size"):
        clone.make_torch_dataloader(batch_size=40, cur_shard=0, shard_count=2)
    with pytest.raises(ConfigError, match="num_epochs must be None"):
        clone.make_torch_dataloader(num_epochs=0, cur_shard=0, shard_count=1)
    with pytest.raises(ConfigError, match="dtype must be"):
        Converter(converter.spec, converter._store, dtype="int32")
    clone.delete()
    assert not converter._store.exists(converter._store.dataset_path(converter.spec.key))
    with pytest.raises(DataError, match="make a new converter"):
        converter.make_torch_dataloader(cur_shard=0, shard_count=1)


def test_unpickling_a_converter_loads_no_framework_or_spark(converter):
    # What a rank does before it opens a loader: it must not pay for pyspark or the
    # other framework (a torch rank never imports TensorFlow, and the reverse).
    code = ("import pickle, sys; conv = pickle.loads(sys.stdin.buffer.read()); "
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'pyspark') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(converter),
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().strip() == "[]"


def test_the_torch_loader_comes_from_the_binding_that_registers_it(converter):
    # The data layer imports no binding: without `import hvd_spark.torch` the converter says
    # what to import; after it, the loader yields torch tensors.
    code = (
        "import pickle, sys\n"
        "from hvd_spark.errors import ConfigError\n"
        "conv = pickle.loads(sys.stdin.buffer.read())\n"
        "try:\n"
        "    conv.make_torch_dataloader(batch_size=4, num_epochs=1, cur_shard=0, shard_count=1)\n"
        "except ConfigError as exc:\n"
        "    print('refused:', exc)\n"
        "import hvd_spark.torch\n"
        "with conv.make_torch_dataloader(batch_size=4, num_epochs=1, cur_shard=0,\n"
        "                                shard_count=1) as loader:\n"
        "    batch = next(iter(loader))\n"
        "print(type(batch['x']).__name__, tuple(batch['x'].shape), len(loader))\n")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(converter),
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    lines = out.stdout.decode().splitlines()
    assert lines[0] == ("refused: Converter.make_torch_dataloader needs hvd_spark.torch: import "
                        "it in the rank first (import hvd_spark.torch as hvd), as for hvd.init()")
    assert lines[1] == f"Tensor (4, 3) {ROWS // 4}"


class _Conf:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key, default)


def _frame(**conf: str) -> SimpleNamespace:
    return SimpleNamespace(sparkSession=SimpleNamespace(conf=_Conf(conf)))


def test_default_store(tmp_path):
    given = str(tmp_path / "given")
    ours = {"hvd_spark.converter.parentCacheDirUrl": given, "spark.master": "yarn"}
    assert _resolve_store(_frame(**ours), None).url.endswith("/given")
    theirs = {"petastorm.spark.converter.parentCacheDirUrl": given, "spark.master": "yarn"}
    assert _resolve_store(_frame(**theirs), None).url.endswith("/given")
    local = _resolve_store(_frame(**{"spark.master": "local[2]"}), None)
    assert local.url.endswith("hvd_spark_converter_cache")
    with pytest.raises(ConfigError, match=r"pass store=\.\.\..*parentCacheDirUrl"):
        _resolve_store(_frame(**{"spark.master": "yarn"}), None)
