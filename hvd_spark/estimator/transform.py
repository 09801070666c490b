"""Batched inference for fitted models: one Arrow batch at a time, never row by row.

``predict_columns`` runs the model in an Arrow UDF (``pyspark.sql.functions.arrow_udf``):
array columns become one ``(rows, width)`` numpy array straight from the Arrow list's
flat value buffer, so no Python object is made per row. (``predict_batch_udf`` hands the
model pandas Series holding one array per row and stacks them, which costs more than the
model itself on wide features.) The model is deserialized once per Python worker and reused
across partitions and calls; Spark ML Vector columns become arrays in the JVM.

``predict_columns_pandas`` is the earlier pandas-UDF path, kept for the transform benchmark
and the tests that compare both.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from typing import Tuple  # noqa: UP035 - pandas_udf reads these hints at run time

import numpy as np
import pandas as pd
import pyarrow as pa

# Deserialized models cached per Python worker process, keyed by a digest of their bytes.
_MODELS: dict[str, Callable] = {}


def cached_predictor(model_bytes: bytes, factory: Callable[[bytes], Callable]) -> Callable:
    """The ``predict`` for ``model_bytes``, built by ``factory`` once per worker process."""
    key = hashlib.sha256(model_bytes).hexdigest()
    if key not in _MODELS:
        _MODELS.clear()  # one model at a time per worker keeps memory bounded
        _MODELS[key] = factory(model_bytes)
    return _MODELS[key]


def _column_array(series) -> np.ndarray:
    """A pandas column of scalars or of arrays -> one numpy array, rows first."""
    first = series.iloc[0] if len(series) else None
    if isinstance(first, (list, np.ndarray)):
        stacked = np.stack([np.asarray(v) for v in series])
        # Integer arrays (ids) keep their type, as in predict_columns and training.
        return stacked if stacked.dtype.kind in "iu" else stacked.astype(np.float32)
    return series.to_numpy()


def predict_columns_pandas(df, feature_cols, output_cols, output_shapes, model_bytes: bytes,
                    factory: Callable[[bytes], Callable], batch_size: int):
    """Return ``df`` with one prediction column per model output (pandas UDF, rows stacked).

    Args:
        df: Input DataFrame holding the feature columns.
        feature_cols: Model inputs, in order.
        output_cols: Names of the new columns.
        output_shapes: Per-row shape of each model output (``()`` or ``(1,)``: a double).
        model_bytes: The trained model, serialized by the framework adapter.
        factory: Module-level function turning model bytes into ``predict``.
        batch_size: Rows per model call inside each Arrow batch.
    """
    from pyspark.sql import functions as F

    work, hidden = _with_array_inputs(df, feature_cols)
    scalar, struct = _output_struct(output_cols, output_shapes)

    def infer(batches: Iterator[Tuple[pd.Series, ...]]) -> Iterator[pd.DataFrame]:  # noqa: UP006
        predict = cached_predictor(model_bytes, factory)
        for columns in batches:
            columns = columns if isinstance(columns, tuple) else (columns,)
            rows = len(columns[0])
            if rows == 0:
                yield pd.DataFrame({name: [] for name in output_cols})
                continue
            inputs = [_column_array(c) for c in columns]
            outputs: list[list[np.ndarray]] = [[] for _ in output_cols]
            for start in range(0, rows, batch_size):
                for i, out in enumerate(predict([x[start : start + batch_size] for x in inputs])):
                    outputs[i].append(np.asarray(out, dtype=np.float64))
            frame = {}
            for name, parts, is_scalar in zip(output_cols, outputs, scalar):
                values = np.concatenate(parts)
                frame[name] = values.reshape(-1) if is_scalar else list(values.reshape(rows, -1))
            yield pd.DataFrame(frame)

    udf = F.pandas_udf(infer, struct)  # iterator-of-series form: batched, model loaded once
    out = "__hvd_out"
    work = work.withColumn(out, udf(*[F.col(h) for h in hidden]))
    return work.select(*df.columns, *[F.col(f"{out}.{name}").alias(name) for name in output_cols])


def _float_leaves(data_type):
    """``data_type`` with the fractional numbers inside (nested) arrays made FloatType,
    else None.

    Integer arrays are left alone: they are ids (an Embedding's input), which float32
    would round above 2**24 and which torch's Embedding refuses as floats.
    """
    from pyspark.sql import types as T

    if isinstance(data_type, T.ArrayType):
        inner = data_type.elementType
        if isinstance(inner, T.ArrayType):
            leaf = _float_leaves(inner)
            return None if leaf is None else T.ArrayType(leaf, data_type.containsNull)
        if isinstance(inner, T.FractionalType):
            return T.ArrayType(T.FloatType(), data_type.containsNull)
    return None


def _with_array_inputs(df, feature_cols, float32: bool = False):
    """``df`` plus one hidden column per feature, Vectors turned into arrays in the JVM.

    With ``float32``, fractional array elements are cast to float in the JVM: the model gets
    float32 anyway (a cast rounds to nearest as numpy's does), and half the bytes cross to
    Python. Integer arrays stay integers (see ``_float_leaves``).
    """
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F

    from hvd_spark.errors import ConfigError

    missing = [c for c in feature_cols if c not in df.columns]
    if missing:
        raise ConfigError(f"transform: feature column(s) {missing} are missing; the DataFrame "
                          f"has {df.columns}")
    hidden = [f"__hvd_in_{i}" for i in range(len(feature_cols))]
    work = df
    if _has_udt(df.schema):
        # Spark 4.3 feeds an Arrow UDF the columnar batches of a Parquet scan directly and
        # fails on any UDT column among them (UNSUPPORTED_DATATYPE: a Vector column, even one
        # the model does not read). A filter that is always true but not deterministic stays
        # in the plan and makes the UDF's input row-based, which handles UDTs.
        work = work.filter(F.spark_partition_id() >= 0)
    for col, tmp in zip(feature_cols, hidden):
        data_type = df.schema[col].dataType
        if isinstance(data_type, VectorUDT):
            value = vector_to_array(F.col(col), "float32" if float32 else "float64")
        elif float32 and _float_leaves(data_type) is not None:
            value = F.col(col).cast(_float_leaves(data_type))
        else:
            value = F.col(col)
        work = work.withColumn(tmp, value)
    return work, hidden


def _has_udt(data_type) -> bool:
    """Whether a user-defined type (e.g. an ML Vector) is anywhere in ``data_type``."""
    from pyspark.sql import types as T

    if isinstance(data_type, T.UserDefinedType):
        return True
    if isinstance(data_type, T.StructType):
        return any(_has_udt(f.dataType) for f in data_type.fields)
    if isinstance(data_type, T.ArrayType):
        return _has_udt(data_type.elementType)
    if isinstance(data_type, T.MapType):
        return _has_udt(data_type.keyType) or _has_udt(data_type.valueType)
    return False


def _output_struct(output_cols, output_shapes):
    """Which outputs are one double per row, and the Spark struct type of all outputs."""
    from pyspark.sql import types as T

    scalar = [math.prod(s) <= 1 for s in output_shapes] or [False] * len(output_cols)
    struct = T.StructType([
        T.StructField(name, T.DoubleType() if is_scalar else T.ArrayType(T.DoubleType()))
        for name, is_scalar in zip(output_cols, scalar)])
    return scalar, struct


def arrow_to_numpy(array, column: str) -> np.ndarray:
    """One Arrow column -> one numpy array, rows first, without a Python step per row.

    Scalars keep their type; (nested) lists become arrays of shape ``(rows, width, ...)``
    read from the flat value buffer: float32 (as the row-by-row path stacked them), but
    integer lists keep their integer type, as training's reader gives them.

    Raises:
        DataError: A row is null, or rows hold lists of different lengths.
    """
    from hvd_spark.errors import DataError

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:
        raise DataError(f"transform: feature column {column!r} has {array.null_count} null "
                        "row(s) in a batch; drop or fill them before transform")
    rows, shape = len(array), []
    while pa.types.is_list(array.type) or pa.types.is_large_list(array.type) \
            or pa.types.is_fixed_size_list(array.type):
        lengths = array.value_lengths().to_numpy(zero_copy_only=False) if len(array) else \
            np.zeros(0, np.int64)
        width = int(lengths[0]) if len(lengths) else 0
        if len(lengths) and (lengths.min() != width or lengths.max() != width):
            raise DataError(
                f"transform: feature column {column!r} holds arrays of different lengths "
                f"({int(lengths.min())} to {int(lengths.max())}) in one batch; every row "
                "must have the model's input size")
        shape.append(width)
        array = array.flatten()  # honours the slice offset, unlike .values
        if array.null_count:
            raise DataError(f"transform: feature column {column!r} has null elements inside "
                            "its arrays; fill them before transform")
    if not shape:
        return array.to_numpy(zero_copy_only=False)
    values = array.to_numpy(zero_copy_only=False)
    if values.dtype.kind not in "iu":
        values = values.astype(np.float32, copy=False)
    return values.reshape(rows, *shape)


def _to_arrow_outputs(outputs, output_cols, scalar, rows: int):
    """Per-output numpy pieces -> the struct Arrow array Spark expects back."""
    fields = []
    for parts, is_scalar in zip(outputs, scalar):
        if rows == 0:
            fields.append(pa.array([], pa.float64() if is_scalar else pa.list_(pa.float64())))
            continue
        values = np.concatenate(parts).astype(np.float64, copy=False).reshape(rows, -1)
        if is_scalar:
            fields.append(pa.array(values.reshape(-1)))
        else:
            offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * values.shape[1])
            fields.append(pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1))))
    return pa.StructArray.from_arrays(fields, names=list(output_cols))


def predict_columns(df, feature_cols, output_cols, output_shapes, model_bytes: bytes,
                    factory: Callable[[bytes], Callable], batch_size: int):
    """Return ``df`` with one prediction column per model output, computed on Arrow batches.

    The same contract and results as ``predict_columns_pandas``; features reach the model
    as numpy arrays made from whole Arrow buffers.

    Args:
        df: Input DataFrame holding the feature columns (numbers, arrays or Vectors).
        feature_cols: Model inputs, in order.
        output_cols: Names of the new columns.
        output_shapes: Per-row shape of each model output (``()`` or ``(1,)``: a double).
        model_bytes: The trained model, serialized by the framework adapter.
        factory: Module-level function turning model bytes into ``predict``.
        batch_size: Rows per model call inside each Arrow batch.

    Raises:
        ConfigError: A feature column is missing (on the driver, before any job runs).
        DataError: A feature row is null or of the wrong length (from the task).
    """
    from pyspark.sql import functions as F

    work, hidden = _with_array_inputs(df, feature_cols, float32=True)
    scalar, struct = _output_struct(output_cols, output_shapes)
    columns_named = list(feature_cols)

    def infer(batches: Iterator[Tuple[pa.Array, ...]]) -> Iterator[pa.Array]:  # noqa: UP006
        predict = cached_predictor(model_bytes, factory)
        for columns in batches:
            columns = columns if isinstance(columns, tuple) else (columns,)
            rows = len(columns[0])
            inputs = [arrow_to_numpy(c, name) for c, name in zip(columns, columns_named)]
            outputs: list[list[np.ndarray]] = [[] for _ in output_cols]
            for start in range(0, rows, batch_size):
                for i, out in enumerate(predict([x[start : start + batch_size] for x in inputs])):
                    outputs[i].append(np.asarray(out))
            yield _to_arrow_outputs(outputs, output_cols, scalar, rows)

    udf = F.arrow_udf(infer, struct)
    out = "__hvd_out"
    work = work.withColumn(out, udf(*[F.col(h) for h in hidden]))
    return work.select(*df.columns, *[F.col(f"{out}.{name}").alias(name) for name in output_cols])
