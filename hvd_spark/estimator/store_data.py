"""The Estimators' Store path: the DataFrame written to the Store as Parquet shards first.

``prepare`` writes (or reuses) the shards through ``data.writer``; ``check_writable``
probes the Store before any Spark job; ``stored_dataset`` finds the data that
``fit_on_parquet`` trains on. The direct path, without a Store, is ``direct_data``.
"""

from __future__ import annotations

import posixpath
import uuid
from typing import Any

from hvd_spark.data.spec import DatasetSpec
from hvd_spark.data.store import Store
from hvd_spark.errors import ConfigError


def prepare(estimator: Any, df: Any, store: Store, num_proc: int) -> DatasetSpec:
    """Write ``df``'s training (and validation) rows to ``store`` and return their spec.

    Args:
        estimator: The Estimator being fitted (its column, batch and validation params).
        df: The training DataFrame.
        store: Where the shards go.
        num_proc: Number of ranks.

    Raises:
        ConfigError, DataError: The DataFrame or a setting cannot work (naming it).
    """
    from hvd_spark.data import writer

    seed = estimator.value("random_seed")
    return writer.write_dataset(
        df, store,
        feature_cols=estimator.value("feature_cols"),
        label_cols=estimator.value("label_cols"),
        sample_weight_col=estimator.value("sample_weight_col"),
        validation=estimator.value("validation"),
        num_proc=num_proc,
        batch_size=estimator.value("batch_size"),
        val_batch_size=estimator.value("val_batch_size"),
        partitions_per_process=estimator.value("partitions_per_process"),
        seed=0 if seed is None else seed,
    )


def check_writable(store: Store) -> None:
    """Write and remove a probe file, so an unwritable store fails before Spark does."""
    probe = store.path(f".hvd_spark_write_probe_{uuid.uuid4().hex[:12]}")
    fs = store.filesystem
    try:
        fs.create_dir(posixpath.dirname(probe), recursive=True)
        with fs.open_output_stream(probe) as out:
            out.write(b"ok")
        fs.delete_file(probe)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises OSError and ArrowException kinds
        raise ConfigError(
            f"store {store.url}: cannot write there ({type(exc).__name__}: {exc}); give a "
            "store path that the driver and every executor can write to") from exc


def stored_dataset(store: Store, dataset_idx: Any, feature_cols: list[str],
                    label_cols: list[str], sample_weight_col: str | None) -> DatasetSpec:
    """The DatasetSpec of ``fit_on_parquet``'s ``dataset_idx`` (see there)."""
    from hvd_spark.data import dataset_index, writer
    from hvd_spark.data.parquet_spec import spec_from_parquet

    if isinstance(dataset_idx, DatasetSpec):
        return dataset_idx
    if dataset_idx is not None:
        return dataset_index.load_dataset_spec(store, dataset_idx)
    path = posixpath.join(store.get_train_data_path(), writer.DATASET_SPEC_FILE)
    if store.exists(path):
        return DatasetSpec.from_json(store.read_bytes(path))
    # Parquet files the user wrote to the store's train (and val) path, as in Horovod.
    return spec_from_parquet(store, feature_cols, label_cols, sample_weight_col)
