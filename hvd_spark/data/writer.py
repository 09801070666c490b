"""Driver side: a Spark DataFrame -> Parquet shards in a Store + a ``DatasetSpec``.

What happens in ``write_dataset``, in this order:

1. ``inspection.inspect_dataframe`` checks the settings, the schema and, in one Spark
   job, the values (nulls, array lengths, NaN, validation rows), and fingerprints the
   content. Any bad input raises ``DataError`` there, before anything is written.
2. The cache key is a SHA-256 of: the content fingerprint and row count, the selected
   columns with their types, the validation setting (fraction and seed, or column), the
   number of files and the format version. Re-fitting the same data with the same
   settings therefore reuses the files, in any session; the key changes (and the data
   is rewritten under a new directory) when any value of a selected column changes,
   when rows are added or removed, or when the columns, validation, seed or
   ``num_proc x partitions_per_process`` change. ``batch_size`` is not part of it.
   Old keys are never deleted automatically: remove ``intermediate_train_data/`` to
   reclaim space.
3. On a miss, the rows are repartitioned into ``num_proc x partitions_per_process``
   partitions and each Spark task writes its train and validation rows as Parquet
   through the Store's pyarrow filesystem (so any filesystem pyarrow supports works
   without Hadoop connectors), in the layout of ``hvd_spark.data.layout``. The spec is
   written last: it is the commit marker, and a dataset directory without one is never
   reused. Threads of one driver preparing the same directory at once (the fits of
   ``CrossValidator(parallelism=n)``) take turns on a lock: one writes, the others reuse.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import fs as pafs

from hvd_spark.data.filesystems import unsplit
from hvd_spark.data.inspection import IS_VAL, VAL_COL, inspect_dataframe
from hvd_spark.data.layout import (
    dictionary_columns,
    pack_arrays,
    row_group_rows,
    storage_schema,
)
from hvd_spark.data.spec import SPEC_VERSION, ColumnSpec, DatasetSpec, SplitSpec
from hvd_spark.data.store import Store
from hvd_spark.errors import ConfigError

logger = logging.getLogger(__name__)

DATASET_SPEC_FILE = "_hvd_spark_spec.json"  # in train_dir; "_" so readers skip it
_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def write_dataset(
    df: Any,
    store: Store | str,
    *,
    feature_cols: Sequence[str] | str,
    label_cols: Sequence[str] | str = (),
    sample_weight_col: str | None = None,
    validation: float | str | None = None,
    num_proc: int,
    batch_size: int,
    val_batch_size: int | None = None,
    partitions_per_process: int = 2,
    seed: int = 0,
    train_dir: str | None = None,
    val_dir: str | None = None,
) -> DatasetSpec:
    """Check ``df``, write it as Parquet shards in ``store`` (or reuse them) and return the spec.

    Args:
        df: A pyspark DataFrame.
        store: A Store or a prefix/URL for ``Store.create``.
        feature_cols: Feature column(s): numbers, arrays of numbers or ML Vectors.
        label_cols: Label column(s), same types as features.
        sample_weight_col: Optional numeric per-row weight column.
        validation: None, a fraction in (0, 1) of rows drawn at random (seeded), or the
            name of a 0/1 or boolean column that marks validation rows.
        num_proc: Number of training processes that will read the data.
        batch_size: Training batch size per process (checks there is enough data).
        val_batch_size: Validation batch size per process; default ``batch_size``.
        partitions_per_process: Parquet files per process.
        seed: Seed of the random validation split.
        train_dir: Directory (under the store's prefix: a full path/URL or relative) to
            write the training files to, instead of the content-addressed cache; the spec
            goes beside them as ``_hvd_spark_spec.json`` (Spark and pyarrow skip ``_``
            files). A dataset already there with the same cache key is reused; anything
            else there is replaced. Used by Horovod's context manager
            (``dataset_index.prepare_data``).
        val_dir: Directory of the validation files when ``train_dir`` is given.

    Returns:
        The ``DatasetSpec`` of the written (or reused) dataset.

    Raises:
        ConfigError: A setting cannot work.
        DataError: The DataFrame cannot be used (the message names the column).
    """
    if not isinstance(partitions_per_process, int) or isinstance(partitions_per_process, bool) \
            or partitions_per_process < 1:
        raise ConfigError(f"partitions_per_process must be an int >= 1, got "
                          f"{partitions_per_process!r}")
    store = Store.create(store)
    found = inspect_dataframe(df, feature_cols=feature_cols, label_cols=label_cols,
                              sample_weight_col=sample_weight_col, validation=validation,
                              num_proc=num_proc, batch_size=batch_size,
                              val_batch_size=val_batch_size, seed=seed)
    columns, selected = found.columns, found.selected
    features, labels = found.feature_cols, found.label_cols
    num_files = num_proc * partitions_per_process
    settings = {
        "validation": validation, "seed": seed if isinstance(validation, float) else None,
        "num_files": num_files, "rows": found.rows,
    }
    key = _cache_key(found.fingerprint, columns, settings)
    layout = _Layout.of(store, key, train_dir, val_dir)
    # Concurrent fits of this driver (CrossValidator(parallelism=n)) preparing the same
    # dataset: one writes it while the others wait, then reuse it.
    with _dataset_lock(store.url_of(layout.root)):
        cached = _cached_spec(store, layout, key)
        if cached is not None:
            logger.info("reusing dataset %s in %s (same data and settings)", key,
                        store.url_of(layout.root))
            return cached
        return _write(store, layout, key, selected, columns, features, labels,
                      sample_weight_col, settings)


def _dataset_lock(root_url: str) -> threading.Lock:
    """The lock of one dataset directory, for the threads of this process."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(root_url, threading.Lock())


def _write(store: Store, layout: _Layout, key: str, selected: Any, columns: list[ColumnSpec],
           features: list[str], labels: list[str], sample_weight_col: str | None,
           settings: dict) -> DatasetSpec:
    """Write the selected rows as Parquet shards under ``layout``; the spec goes last."""
    num_files = settings["num_files"]
    for path in layout.clear:  # a partial write, or another dataset at a fixed location
        store.delete(path)
    out = selected.repartition(num_files)
    written = out.mapInArrow(_ShardWriter(store, layout, columns),
                             "split string, file string, rows long")
    splits = _splits(written.collect())
    spec = DatasetSpec(
        key=key,
        root_url=store.url_of(layout.root),
        columns=tuple(columns),
        feature_cols=tuple(features),
        label_cols=tuple(labels),
        sample_weight_col=sample_weight_col,
        train=splits.get("train", SplitSpec()),
        val=splits.get("val", SplitSpec()),
        settings=settings,
    )
    store.write_bytes(layout.spec, spec.to_json().encode())
    logger.info("wrote dataset %s: %d train / %d val rows", key, spec.train.num_rows,
                spec.val.num_rows)
    return spec


def _cache_key(fingerprint: Any, columns: list[ColumnSpec], settings: dict) -> str:
    payload = {
        "version": SPEC_VERSION, "fingerprint": str(fingerprint), "settings": settings,
        "columns": [[c.name, c.kind, c.dtype, list(c.shape)] for c in columns],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class _Layout:
    """Where one dataset goes: store paths (relative to the prefix, or full)."""

    root: str
    spec: str
    dirs: dict[str, str]
    rel: dict[str, str]  # split directory relative to root, as the spec lists files
    clear: tuple[str, ...]

    @classmethod
    def of(cls, store: Store, key: str, train_dir: str | None,
           val_dir: str | None) -> _Layout:
        if train_dir is None and val_dir is None:
            return cls(store.dataset_path(key), store.spec_path(key),
                       {s: store.data_path(key, s) for s in ("train", "val")},
                       {"train": "train", "val": "val"}, (store.dataset_path(key),))
        dirs = {"train": train_dir, "val": val_dir}
        for split, path in dirs.items():
            if not isinstance(path, str) or not path:
                raise ConfigError(f"{split}_dir must be a path or URL, got {path!r}")
        full = {split: urlsplit(store.get_full_path(path)) for split, path in dirs.items()}
        if full["train"].path.rstrip("/") == full["val"].path.rstrip("/"):
            raise ConfigError(f"train_dir and val_dir must differ, both are {train_dir!r}")
        inside = {split: store.relative(path) for split, path in dirs.items()}
        if all(inside.values()):  # under the prefix: the spec's root_url is the prefix URL
            return cls("", posixpath.join(inside["train"], DATASET_SPEC_FILE), inside, inside,
                       (inside["train"], inside["val"]))
        # Elsewhere on the store's filesystem: files are listed from the common parent.
        common = posixpath.commonpath([full["train"].path, full["val"].path])
        root = unsplit(full["train"]._replace(path=common or "/", query=""))
        rel = {split: posixpath.relpath(f.path, common) for split, f in full.items()}
        return cls(root, posixpath.join(dirs["train"], DATASET_SPEC_FILE), dirs, rel,
                   (dirs["train"], dirs["val"]))


def _cached_spec(store: Store, layout: _Layout, key: str) -> DatasetSpec | None:
    """The committed spec of ``key`` if it exists and all its files are present."""
    if not store.exists(layout.spec):
        return None
    try:
        spec = DatasetSpec.from_json(store.read_bytes(layout.spec))
    except (ValueError, KeyError, TypeError, ConfigError) as exc:
        logger.warning("ignoring unreadable spec of dataset %s: %s", key, exc)
        return None
    if spec.key != key:
        return None
    files = [store.path(layout.root, f) for f in spec.train.files + spec.val.files]
    infos = store.filesystem.get_file_info(files) if files else []
    if any(i.type != pafs.FileType.File for i in infos):
        logger.warning("dataset %s is missing files; rewriting it", key)
        return None
    return spec


def _splits(rows: list) -> dict[str, SplitSpec]:
    by_split: dict[str, list[tuple[str, int]]] = {}
    for row in rows:
        by_split.setdefault(row["split"], []).append((row["file"], int(row["rows"])))
    out = {}
    for split, items in by_split.items():
        items.sort()
        out[split] = SplitSpec(
            files=tuple(f for f, _ in items),
            num_rows=sum(r for _, r in items),
            file_rows=tuple(r for _, r in items),
        )
    return out


class _ShardWriter:
    """The ``mapInArrow`` function: writes one partition's train/val rows as Parquet files."""

    def __init__(self, store: Store, layout: _Layout, columns: Sequence[ColumnSpec]) -> None:
        self.store = store
        self.layout = layout
        self.columns = list(columns)

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        part = TaskContext.get().partitionId()
        writers: dict[str, tuple[Any, Any, str, str]] = {}
        counts = {"train": 0, "val": 0}
        try:
            for batch in batches:
                mask = batch.column(IS_VAL)
                data = pa.Table.from_batches([batch]).drop_columns(
                    [c for c in (IS_VAL, VAL_COL) if c in batch.schema.names])
                data = pack_arrays(data, self.columns)
                for split, rows in (("train", data.filter(pc.invert(mask))),
                                    ("val", data.filter(mask))):
                    if rows.num_rows == 0:
                        continue
                    rows = rows.cast(storage_schema(rows.schema))
                    if split not in writers:
                        writers[split] = self._open(split, part, rows.schema)
                    writers[split][1].write_table(rows, row_group_size=row_group_rows(rows))
                    counts[split] += rows.num_rows
        finally:
            for stream, writer, _, _ in writers.values():
                writer.close()
                stream.close()
        fs = self.store.filesystem
        out = {"split": [], "file": [], "rows": []}
        for split, (_, _, temp, final) in writers.items():
            if temp != final:
                fs.move(temp, final)  # publish only complete files
            out["split"].append(split)
            out["file"].append(posixpath.join(self.layout.rel[split], posixpath.basename(final)))
            out["rows"].append(counts[split])
        if out["split"]:
            yield pa.RecordBatch.from_pydict(
                out, schema=pa.schema([("split", pa.string()), ("file", pa.string()),
                                       ("rows", pa.int64())]))

    def _open(self, split: str, part: int, schema: pa.Schema) -> tuple[Any, Any, str, str]:
        fs = self.store.filesystem
        directory = self.store.path(self.layout.dirs[split])
        fs.create_dir(directory, recursive=True)
        final = posixpath.join(directory, f"part-{part:05d}.parquet")
        temp = final + ".tmp" if fs.type_name in ("local", "hdfs") else final
        stream = fs.open_output_stream(temp)
        writer = pq.ParquetWriter(stream, schema, use_dictionary=dictionary_columns(schema))
        return stream, writer, temp, final
