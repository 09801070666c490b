"""Model.transform's Arrow path gives the same predictions as the row-by-row pandas path."""

from __future__ import annotations

import cloudpickle
import numpy as np
import pytest
import torch
from pyspark.ml.linalg import Vectors

from hvd_spark.errors import ConfigError, DataError
from hvd_spark.estimator import transform
from hvd_spark.estimator.torch_worker import torch_predictor

FEATURES = 12


class TwoHeads(torch.nn.Module):
    """Two inputs (a vector and a scalar), two outputs (3 values and 1 value per row)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(FEATURES + 1, 3)

    def forward(self, x, s):
        h = self.dense(torch.cat([x, s], dim=1))
        return h, h.sum(dim=1, keepdim=True).tanh()


def _model_bytes() -> bytes:
    torch.manual_seed(3)
    return cloudpickle.dumps({"model": TwoHeads(), "input_shapes": [[-1, FEATURES], [-1, 1]]})


@pytest.fixture(scope="module")
def frame(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, FEATURES))
    big = (x * 1e7).astype(np.int64)  # integers that float32 must round
    rows = [(i, x[i].tolist(), Vectors.dense(x[i]) if i % 2 else Vectors.sparse(
        FEATURES, {0: float(x[i, 0]), 5: float(x[i, 5])}), big[i].tolist(), float(i) / 100)
        for i in range(len(x))]
    return spark.createDataFrame(rows, ["id", "arr", "vec", "ints", "s"]).repartition(3)


@pytest.mark.parametrize("feature", ["arr", "vec", "ints"])
def test_arrow_path_predictions_identical_to_the_pandas_path(frame, feature):
    args = ([feature, "s"], ["out3", "out1"], [(3,), (1,)], _model_bytes(), torch_predictor, 7)
    new = transform.predict_columns(frame, *args)
    old = transform.predict_columns_pandas(frame, *args)
    assert new.columns == ["id", "arr", "vec", "ints", "s", "out3", "out1"]
    assert new.schema == old.schema
    new_rows = sorted(new.select("id", "out3", "out1").collect())
    old_rows = sorted(old.select("id", "out3", "out1").collect())
    assert len(new_rows) == 1000
    assert new_rows == old_rows  # bit-identical doubles, not merely close
    # And what the model computes directly on the same inputs (a batch of other rows may
    # round the last float32 bit differently, hence allclose here).
    model = cloudpickle.loads(_model_bytes())["model"]
    first = sorted(frame.collect())[:5]
    x = np.array([np.asarray(r[feature].toArray() if feature == "vec" else r[feature],
                             np.float32) for r in first])
    s = np.array([[r["s"]] for r in first], np.float32)
    with torch.no_grad():
        want3, want1 = model(torch.from_numpy(x), torch.from_numpy(s))
    np.testing.assert_allclose([r["out3"] for r in new_rows[:5]], want3.numpy(), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose([r["out1"] for r in new_rows[:5]], want1.numpy().reshape(-1),
                               rtol=1e-5, atol=1e-6)


def test_empty_partitions_and_frames(spark, frame):
    args = (["arr", "s"], ["out3", "out1"], [(3,), (1,)], _model_bytes(), torch_predictor, 7)
    assert transform.predict_columns(frame.limit(0), *args).count() == 0
    sparse = frame.limit(2).repartition(5)  # most partitions are empty
    assert len(transform.predict_columns(sparse, *args).collect()) == 2


def test_missing_column_named_before_any_job(frame):
    with pytest.raises(ConfigError, match=r"feature column\(s\) \['nope'\] are missing"):
        transform.predict_columns(frame, ["nope"], ["o"], [(1,)], _model_bytes(),
                                  torch_predictor, 8)


def test_ragged_and_null_arrays_are_data_errors():
    import pyarrow as pa

    with pytest.raises(DataError, match="'f' holds arrays of different lengths"):
        transform.arrow_to_numpy(pa.array([[1.0, 2.0], [3.0]]), "f")
    with pytest.raises(DataError, match="'f' has 1 null row"):
        transform.arrow_to_numpy(pa.array([[1.0, 2.0], None]), "f")
    sliced = pa.array([[9.0, 9.0], [1.0, 2.0], [3.0, 4.0]]).slice(1)
    got = transform.arrow_to_numpy(sliced, "f")
    assert got.dtype == np.float32 and got.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    nested = transform.arrow_to_numpy(pa.array([[[1.0], [2.0]], [[3.0], [4.0]]]), "f")
    assert nested.shape == (2, 2, 1)
    assert transform.arrow_to_numpy(pa.array([1, 2], pa.int64()), "f").dtype == np.int64
