"""A few rows of a DataFrame as the ranks' reader will yield them, with nothing written.

The Estimators' dry run (``hvd_spark.estimator.dry_run``) feeds such a batch to the model
on the driver. It goes through the writer's own column selection and conversion (ML
Vectors to float32 arrays, arrays and scalars keeping their element type, see
``inspection.column_specs`` and ``inspection.select_columns``) and then through the Parquet layout's
packing and the reader's unpacking, so dtypes and shapes equal what a rank gets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from hvd_spark.data.layout import pack_arrays
from hvd_spark.data.reader import table_to_numpy
from hvd_spark.data.spec import ColumnSpec

Batch = dict[str, np.ndarray]


@dataclass(frozen=True)
class Sample:
    """Rows of the selected columns, as a rank's reader yields them.

    Attributes:
        batch: Column name -> numpy array, rows first.
        columns: The stored form of each column (dtype, per-row shape, kind).
        types: Column name -> its Spark type as Spark writes it (``double``, ``bigint``,
            ``vector``, ``array<float>``), for messages.
    """

    batch: Batch
    columns: dict[str, ColumnSpec]
    types: dict[str, str]

    @property
    def rows(self) -> int:
        """Rows in the sample."""
        return len(next(iter(self.batch.values())))


def sample_rows(df: Any, columns: Sequence[str], rows: int = 8) -> Sample | None:
    """The first ``rows`` rows of ``columns`` of ``df``, converted as ``write_dataset`` stores
    them and the reader reads them back.

    Args:
        df: A pyspark DataFrame (classic or Spark Connect).
        columns: Feature, label and weight columns, in any order.
        rows: How many rows to take (one small Spark job, ``df.limit``).

    Returns:
        The sample, or None when the rows cannot be converted (no rows, nulls, arrays of
        unequal length): ``write_dataset`` then refuses the DataFrame with its own message.

    Raises:
        DataError: A column is missing or of a type that cannot be stored (the writer's
            own schema check, which needs no Spark job).
    """
    from hvd_spark.data import inspection

    names = list(dict.fromkeys(columns))
    specs = inspection.column_specs(df, names, None)
    selected, _ = inspection.select_columns(df, specs, None, 0)
    # take(), not toArrow(): for a handful of rows it is about half the time (no Arrow
    # stream set up), and these rows become Arrow columns of the stored types right here.
    found = selected.drop(inspection.IS_VAL).take(rows)
    if not found:
        return None
    arrays, shaped = [], []
    for spec in specs:
        values = [row[spec.name] for row in found]
        element = pa.from_numpy_dtype(np.dtype(spec.dtype))
        if any(v is None for v in values):
            return None
        if spec.kind == "scalar":
            arrays.append(pa.array(values, element))
            shaped.append(spec)
            continue
        lengths = {len(v) for v in values}
        if len(lengths) != 1 or 0 in lengths or any(x is None for v in values for x in v):
            return None
        arrays.append(pa.array(values, pa.list_(element)))
        shaped.append(ColumnSpec(spec.name, spec.dtype, (lengths.pop(),), spec.kind))
    packed = pack_arrays(pa.table(arrays, names=names), shaped)
    batch = table_to_numpy(packed, names, {c.name: c.shape for c in shaped},
                           {c.name: np.dtype(c.dtype) for c in shaped})
    types = {name: _spark_type(df, name) for name in names}
    return Sample(batch, {c.name: c for c in shaped}, types)


def _spark_type(df: Any, name: str) -> str:
    data_type = df.schema[name].dataType
    return "vector" if type(data_type).__name__ == "VectorUDT" else data_type.simpleString()


def describe(sample: Sample, name: str) -> str:
    """``'label' (double)``: a column and its Spark type, for messages."""
    return f"{name!r} ({sample.types.get(name, '?')})"


__all__ = ["Sample", "describe", "sample_rows"]
