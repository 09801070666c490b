"""Data layer: Stores, DataFrame -> Parquet (driver) and sharded batch reading (workers).

``write_dataset`` (the only pyspark user) is imported lazily so that workers importing
``hvd_spark.data`` for the reader never load pyspark; so is ``make_converter`` (petastorm's
``make_spark_converter`` for ``run()``, in ``converter``). ``prepare_data`` means one thing:
Horovod's context manager (``horovod.spark.common.util``), ``hvd_spark.data.dataset_index``'s.
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
    "make_converter", "write_dataset",
]

# Where the names that turn batches into framework tensors went (the data layer imports
# no framework): their old spelling gets an error that names the new one.
_MOVED = {"as_torch": "hvd_spark.torch.data", "as_tf_dataset": "hvd_spark.tensorflow.data"}


def __getattr__(name: str) -> Any:
    if name == "write_dataset":
        from hvd_spark.data.writer import write_dataset

        return write_dataset
    if name == "prepare_data":
        # This package's writer was named like Horovod's context manager, with other
        # arguments; the old name keeps working, once warned, so the rename breaks nobody.
        import warnings

        from hvd_spark.data.writer import write_dataset

        warnings.warn("hvd_spark.data.prepare_data is now hvd_spark.data.write_dataset (same "
                      "arguments); Horovod's prepare_data context manager is "
                      "hvd_spark.data.dataset_index.prepare_data", DeprecationWarning,
                      stacklevel=2)
        return write_dataset
    if name in _MOVED:
        raise AttributeError(f"hvd_spark.data.{name} is now {_MOVED[name]}.{name} "
                             f"(from {_MOVED[name]} import {name})")
    if name in ("make_converter", "Converter"):
        from hvd_spark.data import converter

        return getattr(converter, name)
    raise AttributeError(f"module 'hvd_spark.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names (make_converter, Converter, write_dataset) too: the API reference and
    # tab completion list what __dir__ returns.
    return sorted({*globals(), *__all__})
