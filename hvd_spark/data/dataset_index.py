"""Horovod's ``prepare_data`` context manager: a DataFrame -> a numbered dataset in a Store.

Horovod's ``horovod.spark.common.util.prepare_data`` (the module to alias it to is this
one) writes a DataFrame once and yields a *dataset index* ``idx``; the data then lies at
``store.get_train_data_path(idx)`` and ``store.get_val_data_path(idx)`` and
``est.fit_on_parquet(dataset_idx=idx)`` trains on it::

    with dataset_index.prepare_data(2, store, df, label_columns=["y"],
                                    feature_columns=["x"], validation=0.2) as idx:
        model = est.fit_on_parquet(dataset_idx=idx)

As in Horovod, an index stays reserved while a ``with`` block uses it; the same DataFrame
and settings get the same index again (and reuse the files, checked by content through
the writer's cache key), and a free index is reused by another DataFrame, whose files
replace the old ones. Unlike Horovod, the files are written in this package's layout
(``hvd_spark.data.layout``) with a spec beside them (``_hvd_spark_spec.json``, skipped by
Spark and pyarrow as a ``_`` file), which ``load_dataset_spec`` reads.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import numpy as np

from hvd_spark.data import writer
from hvd_spark.data.spec import DatasetSpec
from hvd_spark.data.store import Store
from hvd_spark.errors import ConfigError, DataError

log = logging.getLogger(__name__)

_lock = threading.Lock()
# Per store location (train base, val base): index -> key of the data it last held.
_owners: dict[tuple[str, str], dict[int, Hashable]] = {}
_in_use: Counter[Hashable] = Counter()
_specs: dict[int, DatasetSpec] = {}


@contextlib.contextmanager
def prepare_data(
    num_processes: int,
    store: Store | str,
    df: Any,
    label_columns: Sequence[str] | None = None,
    feature_columns: Sequence[str] | None = None,
    validation: float | str | None = None,
    sample_weight_col: str | None = None,
    compress_sparse: bool = False,
    partitions_per_process: int = 10,
    verbose: int = 0,
) -> Iterator[int]:
    """Write ``df`` to ``store`` (or reuse what is there) and yield its dataset index.

    Args:
        num_processes: Number of training processes that will read the data.
        store: A Store, or a prefix/URL for ``Store.create``.
        df: A pyspark DataFrame.
        label_columns: Label column(s); required, as in Horovod.
        feature_columns: Feature columns; default: every column that is not a label, the
            weight or the validation column.
        validation: None (or 0), a fraction in (0, 1), or a 0/1 or boolean column.
        sample_weight_col: Optional per-row weight column.
        compress_sparse: Ignored: Vectors are stored dense and packed (see the layout).
        partitions_per_process: Parquet files per process.
        verbose: > 0 logs the paths and row counts at INFO level.

    Yields:
        The dataset index: ``store.get_train_data_path(idx)`` holds the training files.

    Raises:
        ConfigError: A setting cannot work (a ``ValueError``, as Horovod raises).
        DataError: A column is missing or cannot be used.
    """
    labels = _names("label_columns", label_columns)
    if not labels:
        raise ConfigError("label_columns must name at least one column (Horovod requires it)")
    for name, value in (("num_processes", num_processes),
                        ("partitions_per_process", partitions_per_process)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    if validation == 0 and not isinstance(validation, (bool, str)):
        validation = None  # Horovod treats 0 as "no validation"
    if isinstance(validation, str) and validation not in df.columns:
        raise DataError(f"validation column {validation!r} not found in the DataFrame; "
                        f"available columns: {', '.join(df.columns)}")
    if compress_sparse:
        log.info("prepare_data ignores compress_sparse=True: Vectors are stored dense, packed")
    if feature_columns is None:
        val_col = validation if isinstance(validation, str) else None
        skip = set(labels) | {sample_weight_col, val_col}
        features = [c for c in df.columns if c not in skip]
    else:
        features = _names("feature_columns", feature_columns)
    store = Store.create(store)
    location = (store.get_train_data_path(), store.get_val_data_path())
    key = (_frame_id(df), tuple(features), tuple(labels), sample_weight_col, validation,
           num_processes * partitions_per_process, location)
    with _lock:  # held while writing, as Horovod does: one index is written at a time
        idx = _assign(location, key)
        _in_use[key] += 1
        try:
            spec = writer.write_dataset(
                df, store, feature_cols=features, label_cols=labels,
                sample_weight_col=sample_weight_col, validation=validation,
                num_proc=num_processes, batch_size=1,
                partitions_per_process=partitions_per_process,
                train_dir=store.get_train_data_path(idx),
                val_dir=store.get_val_data_path(idx),
            )
        except BaseException:
            _in_use[key] -= 1
            raise
        _specs[idx] = spec
    if verbose:
        log.info("dataset %d: %d train rows at %s, %d val rows at %s", idx, spec.train.num_rows,
                 store.get_train_data_path(idx), spec.val.num_rows, store.get_val_data_path(idx))
    try:
        yield idx
    finally:
        with _lock:
            _in_use[key] -= 1


def load_dataset_spec(store: Store | str, dataset_idx: int) -> DatasetSpec:
    """The ``DatasetSpec`` of the dataset ``prepare_data`` wrote as ``dataset_idx``.

    Reads it from the store, so it works in any process and session.

    Raises:
        DataError: No dataset was prepared under that index in this store.
    """
    store = Store.create(store)
    if not isinstance(dataset_idx, int) or isinstance(dataset_idx, bool) or dataset_idx < 0:
        raise ConfigError(f"dataset_idx must be an int >= 0, got {dataset_idx!r}")
    train = store.get_train_data_path(dataset_idx)
    path = f"{train}/{writer.DATASET_SPEC_FILE}"
    if not store.exists(path):
        raise DataError(
            f"no dataset {dataset_idx} in {train}: write it first with "
            "hvd_spark.data.dataset_index.prepare_data(...) (Horovod's util.prepare_data)"
        )
    return DatasetSpec.from_json(store.read_bytes(path))


def get_dataset_properties(dataset_idx: int) -> tuple[int, int, dict[str, Any], int]:
    """Horovod's ``(train_rows, val_rows, metadata, avg_row_size)`` of a prepared dataset.

    ``metadata`` maps each column to its ``dtype``, ``shape`` (of one row) and ``kind``;
    ``avg_row_size`` is the bytes of one row's values, uncompressed.
    """
    with _lock:
        spec = _specs.get(dataset_idx)
    if spec is None:
        raise DataError(f"dataset {dataset_idx!r} was not prepared in this process "
                        "(use load_dataset_spec(store, idx) to read one from a store)")
    metadata = {c.name: {"dtype": c.dtype, "shape": tuple(c.shape), "kind": c.kind}
                for c in spec.columns}
    row = sum(int(np.prod(c.shape, dtype=np.int64)) * np.dtype(c.dtype).itemsize
              for c in spec.columns)
    return spec.train.num_rows, spec.val.num_rows, metadata, row


def clear_training_cache() -> None:
    """Forget which index holds which DataFrame (the files stay in the store)."""
    with _lock:
        _owners.clear()
        _specs.clear()
        _in_use.clear()


def _assign(location: tuple[str, str], key: Hashable) -> int:
    """The index already holding ``key``, else the lowest index no ``with`` block uses."""
    owners = _owners.setdefault(location, {})
    for idx, owner in owners.items():
        if owner == key:
            return idx
    idx = 0
    while idx in owners and _in_use[owners[idx]] > 0:
        idx += 1
    owners[idx] = key
    return idx


def _frame_id(df: Any) -> Hashable:
    # The plan's semantic hash identifies the same query; the writer's content key
    # decides whether the files really are the same.
    try:
        return ("plan", int(df.semanticHash()))
    except Exception:  # noqa: BLE001 - Spark Connect or an old DataFrame: object identity
        return ("object", id(df))


def _names(param: str, value: Sequence[str] | str | None) -> list[str]:
    names = [value] if isinstance(value, str) else list(value or ())
    if not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{param} must be column names (strings), got {value!r}")
    return names
