"""Data layer: Stores, DataFrame -> Parquet (driver) and sharded batch reading (workers).

``prepare_data`` (the only pyspark user) is imported lazily so that workers importing
``hvd_spark.data`` for the reader never load pyspark; so is ``make_converter`` (petastorm's
``make_spark_converter`` for ``run()``, in ``converter``). Horovod's context-manager
``prepare_data`` (``horovod.spark.common.util``) is ``hvd_spark.data.dataset_index``'s.
Batches as tensors come from the framework bindings: ``hvd_spark.torch.data.as_torch``
and ``hvd_spark.tensorflow.data.as_tf_dataset``.
"""

from __future__ import annotations

from typing import Any

from hvd_spark.data.reader import ShardReader
from hvd_spark.data.spec import ColumnSpec, DatasetSpec, SplitSpec
from hvd_spark.data.store import (
    AbstractFilesystemStore,
    DBFSLocalStore,
    FilesystemStore,
    HDFSStore,
    LocalStore,
    Store,
)

__all__ = [
    "AbstractFilesystemStore", "ColumnSpec", "DatasetSpec", "DBFSLocalStore", "FilesystemStore",
    "HDFSStore", "LocalStore", "ShardReader", "SplitSpec", "Store", "Converter",
    "make_converter", "prepare_data",
]

# Where the names that turn batches into framework tensors went (the data layer imports
# no framework): their old spelling gets an error that names the new one.
_MOVED = {"as_torch": "hvd_spark.torch.data", "as_tf_dataset": "hvd_spark.tensorflow.data"}


def __getattr__(name: str) -> Any:
    if name == "prepare_data":
        from hvd_spark.data.writer import prepare_data

        return prepare_data
    if name in _MOVED:
        raise AttributeError(f"hvd_spark.data.{name} is now {_MOVED[name]}.{name} "
                             f"(from {_MOVED[name]} import {name})")
    if name in ("make_converter", "Converter"):
        from hvd_spark.data import converter

        return getattr(converter, name)
    raise AttributeError(f"module 'hvd_spark.data' has no attribute {name!r}")
