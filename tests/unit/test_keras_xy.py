"""The Keras worker's batch -> ``(x, y)`` step and transform's Arrow -> numpy step, for
models with several inputs or outputs and integer (categorical) columns (no Spark, no fit)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa

from hvd_spark.estimator import transform
from hvd_spark.estimator.keras_worker import batch_xy


def _dataset(features: list[str], labels: list[str], weight: str | None = None):
    # batch_xy reads only the column names of the DatasetSpec.
    return SimpleNamespace(feature_cols=tuple(features), label_cols=tuple(labels),
                           sample_weight_col=weight)


def _batch(rows: int = 4) -> dict[str, np.ndarray]:
    return {
        "cat": np.arange(rows, dtype=np.int64),
        "cat32": np.arange(rows, dtype=np.int32),
        "price": np.linspace(0.0, 1.0, rows),  # float64 from a double column
        "vec": np.ones((rows, 3), np.float32),
        "y": np.zeros(rows, np.float64),
        "y2": np.ones(rows, np.int64),
        "w": np.full(rows, 2.0),
    }


def test_several_feature_columns_become_a_tuple_in_column_order():
    x, y = batch_xy(_batch(), _dataset(["cat", "price", "vec"], ["y"]),
               [(1,), (1,), (3,)], [(1,)])
    # A list here makes Keras 3's generator adapter fail (output_signature must be TypeSpecs).
    assert type(x) is tuple and len(x) == 3
    assert [a.shape for a in x] == [(4, 1), (4, 1), (4, 3)]
    np.testing.assert_array_equal(x[0].reshape(-1), np.arange(4))
    assert isinstance(y, np.ndarray) and y.shape == (4, 1) and y.dtype == np.float32


def test_integer_columns_keep_their_dtype_and_floats_become_float32():
    x, _ = batch_xy(_batch(), _dataset(["cat", "cat32", "price", "vec"], ["y"]),
               [(1,), (), (1,), (3,)], [(1,)])
    assert [a.dtype for a in x] == [np.int64, np.int32, np.float32, np.float32]
    assert x[1].shape == (4,), "a () input shape leaves the scalar column flat"


def test_one_feature_column_stays_one_array():
    x, y = batch_xy(_batch(), _dataset(["vec"], ["y"]), [(3,)], [(1,)])
    assert isinstance(x, np.ndarray) and x.shape == (4, 3)
    assert isinstance(y, np.ndarray)


def test_several_label_columns_become_a_tuple_and_the_weight_comes_third():
    out = batch_xy(_batch(), _dataset(["cat", "vec"], ["y", "y2"], "w"), [(1,), (3,)],
              [(1,), (1,)])
    assert len(out) == 3
    x, y, w = out
    assert type(x) is tuple and type(y) is tuple and len(y) == 2
    assert [a.dtype for a in y] == [np.float32, np.int64]
    assert w.dtype == np.float32 and w.tolist() == [2.0] * 4


def test_columns_beyond_the_models_shapes_are_not_dropped():
    # A model with fewer inputs than feature columns must fail in Keras, naming the
    # mismatch, rather than silently train on the first columns only.
    x, _ = batch_xy(_batch(), _dataset(["cat", "price", "vec"], ["y"]), [(1,)], [(1,)])
    assert len(x) == 3 and x[2].shape == (4, 3)


def test_transform_keeps_integer_arrays_integers():
    # float32 would round 2**24 + 1 to 2**24, and torch's Embedding refuses floats.
    ids = pa.array([[1, 2**24 + 1], [3, 4]], pa.list_(pa.int64()))
    got = transform.arrow_to_numpy(ids, "ids")
    assert got.dtype == np.int64 and got.tolist() == [[1, 2**24 + 1], [3, 4]]
    floats = transform.arrow_to_numpy(pa.array([[1.0, 2.0]], pa.list_(pa.float64())), "f")
    assert floats.dtype == np.float32
