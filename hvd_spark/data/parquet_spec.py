"""A ``DatasetSpec`` for Parquet files the user wrote (Horovod's ``fit_on_parquet()``).

Horovod users write their own data, e.g. ``df.write.parquet(store.get_train_data_path())``,
and train with ``est.fit_on_parquet()``. Those files are plain Parquet, not the packed
layout of ``hvd_spark.data.layout``; the reader reads them as they are. This module
describes them: numeric columns become scalars, list columns of numbers become arrays
(of the length of their first row; the reader checks every batch), and anything else
(strings, Spark ML Vectors stored as structs) is a ``DataError`` saying how to convert it.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Sequence
from urllib.parse import urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hvd_spark.data.filesystems import unsplit
from hvd_spark.data.spec import ColumnSpec, DatasetSpec, SplitSpec
from hvd_spark.data.store import Store
from hvd_spark.errors import ConfigError, DataError


def spec_from_parquet(
    store: Store | str,
    feature_cols: Sequence[str],
    label_cols: Sequence[str] = (),
    sample_weight_col: str | None = None,
    train_path: str | None = None,
    val_path: str | None = None,
) -> DatasetSpec:
    """Describe the Parquet files at ``train_path`` (and ``val_path``) as a ``DatasetSpec``.

    Args:
        store: The Store (or its prefix) the files are on.
        feature_cols: Feature column names.
        label_cols: Label column names.
        sample_weight_col: Optional per-row weight column.
        train_path: Directory (or file) of the training data; default
            ``store.get_train_data_path()``.
        val_path: Directory of the validation data; default ``store.get_val_data_path()``
            when a Parquet dataset is there, else no validation data.

    Returns:
        The spec; its ``root_url`` is the common parent of the two paths.

    Raises:
        DataError: No Parquet files, a missing column, or a column the reader cannot use.
    """
    store = Store.create(store)
    names = [*feature_cols, *label_cols, *([sample_weight_col] if sample_weight_col else [])]
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"feature/label columns must be non-empty names, got {names!r}")
    train = train_path or store.get_train_data_path()
    if not store.is_parquet_dataset(train):
        raise DataError(
            f"no readable Parquet files at {store.get_full_path(train)}: write them there "
            "(df.write.parquet(store.get_train_data_path())) or use write_dataset"
        )
    paths = {"train": train}
    val = val_path or store.get_val_data_path()
    if store.is_parquet_dataset(val):
        paths["val"] = val
    elif val_path is not None:
        raise DataError(f"no readable Parquet files at validation path {val_path!r}")
    files = {split: sorted(store.get_parquet_dataset(p).files) for split, p in paths.items()}
    root = posixpath.commonpath([posixpath.dirname(f) for fs in files.values() for f in fs])
    splits = {}
    for split, paths_ in files.items():
        rows = [pq.read_metadata(f, filesystem=store.filesystem).num_rows for f in paths_]
        rel = tuple(posixpath.relpath(f, root) for f in paths_)
        splits[split] = SplitSpec(rel, sum(rows), tuple(rows))
    columns = _columns(store, files["train"][0], names)
    key = hashlib.sha256(repr(sorted(files.items())).encode()).hexdigest()[:24]
    return DatasetSpec(
        key=f"parquet-{key}", root_url=_url(store, root), columns=tuple(columns),
        feature_cols=tuple(feature_cols), label_cols=tuple(label_cols),
        sample_weight_col=sample_weight_col, train=splits["train"],
        val=splits.get("val", SplitSpec()), settings={"source": "parquet"},
    )


def _columns(store: Store, first_file: str, names: list[str]) -> list[ColumnSpec]:
    schema = pq.read_schema(first_file, filesystem=store.filesystem)
    missing = [n for n in names if n not in schema.names]
    if missing:
        raise DataError(f"column(s) {missing} not in the Parquet files; they have: "
                        f"{', '.join(schema.names)}")
    lists = [n for n in names if _is_list(schema.field(n).type)]
    first = pq.ParquetFile(first_file, filesystem=store.filesystem).read_row_group(
        0, columns=lists).slice(0, 1) if lists else None
    out = []
    for name in names:
        data_type = schema.field(name).type
        if _is_list(data_type) and _is_number(data_type.value_type):
            length = len(first.column(name)[0]) if first is not None and first.num_rows else 0
            if not length:
                raise DataError(f"column {name!r} holds empty (or no) arrays")
            out.append(ColumnSpec(name, _dtype(data_type.value_type), (length,), "array"))
        elif _is_number(data_type):
            out.append(ColumnSpec(name, _dtype(data_type), (), "scalar"))
        else:
            raise DataError(
                f"column {name!r} has Parquet type {data_type}; columns must be numbers or "
                "lists of numbers. Convert Spark ML Vectors with "
                "pyspark.ml.functions.vector_to_array before writing, or use write_dataset"
            )
    return out


def _url(store: Store, fs_path: str) -> str:
    """URL of a path on the store's filesystem, openable in another process."""
    prefix = store.url
    if not urlsplit(prefix).scheme or prefix.startswith("/"):
        return fs_path
    split = urlsplit(prefix)
    if split.scheme == "hdfs":
        return unsplit(split._replace(path=fs_path))
    bucket, _, key = fs_path.partition("/")
    return unsplit(split._replace(netloc=bucket, path="/" + key))


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _dtype(t: pa.DataType) -> str:
    return np.dtype(t.to_pandas_dtype()).name
