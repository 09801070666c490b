"""Batched inference for fitted models: one Arrow/pandas batch at a time, never row by row.

The model is deserialized once per Python worker and reused across partitions;
Spark ML Vector columns are turned into arrays before they reach pandas.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from typing import Tuple  # noqa: UP035 - pandas_udf reads these hints at run time

import numpy as np
import pandas as pd

# Deserialized models cached per Python worker process, keyed by a digest of their bytes.
_MODELS: dict[str, Callable] = {}


def _predictor(model_bytes: bytes, factory: Callable[[bytes], Callable]) -> Callable:
    key = hashlib.sha256(model_bytes).hexdigest()
    if key not in _MODELS:
        _MODELS.clear()  # one model at a time per worker keeps memory bounded
        _MODELS[key] = factory(model_bytes)
    return _MODELS[key]


def _column_array(series) -> np.ndarray:
    """A pandas column of scalars or of arrays -> one numpy array, rows first."""
    first = series.iloc[0] if len(series) else None
    if isinstance(first, (list, np.ndarray)):
        return np.stack([np.asarray(v, dtype=np.float32) for v in series])
    return series.to_numpy()


def predict_columns(df, feature_cols, output_cols, output_shapes, model_bytes: bytes,
                    factory: Callable[[bytes], Callable], batch_size: int):
    """Return ``df`` with one prediction column per model output.

    Args:
        df: Input DataFrame holding the feature columns.
        feature_cols: Model inputs, in order.
        output_cols: Names of the new columns.
        output_shapes: Per-row shape of each model output (``()`` or ``(1,)``: a double).
        model_bytes: The trained model, serialized by the framework adapter.
        factory: Module-level function turning model bytes into ``predict``.
        batch_size: Rows per model call inside each Arrow batch.
    """
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from hvd_spark.errors import ConfigError

    missing = [c for c in feature_cols if c not in df.columns]
    if missing:
        raise ConfigError(f"transform: feature column(s) {missing} are missing; the DataFrame "
                          f"has {df.columns}")
    hidden = [f"__hvd_in_{i}" for i in range(len(feature_cols))]
    work = df
    for col, tmp in zip(feature_cols, hidden):
        is_vector = isinstance(df.schema[col].dataType, VectorUDT)
        work = work.withColumn(tmp, vector_to_array(F.col(col)) if is_vector else F.col(col))
    scalar = [math.prod(s) <= 1 for s in output_shapes] or [False] * len(output_cols)
    struct = T.StructType([
        T.StructField(name, T.DoubleType() if is_scalar else T.ArrayType(T.DoubleType()))
        for name, is_scalar in zip(output_cols, scalar)])

    def infer(batches: Iterator[Tuple[pd.Series, ...]]) -> Iterator[pd.DataFrame]:  # noqa: UP006
        predict = _predictor(model_bytes, factory)
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
