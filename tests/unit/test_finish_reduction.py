"""finish_reduction: Average and postscale as Horovod applies them."""

import ml_dtypes
import numpy as np
import pytest

from hvd_spark.collectives import ops


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_floats_scale_once_by_postscale_over_size(dtype):
    summed = np.array([3.0, 7.0, -1.25, 1e-3], dtype)
    got = summed.copy()
    ops.finish_reduction(got, ops.ReduceOp.Average, 0.3, 3)
    want = (summed.astype(np.float64) * (0.3 / 3)).astype(dtype) if dtype == np.float64 else \
        (summed.astype(np.float32) * np.float32(0.3 / 3)).astype(dtype)
    assert got.tobytes() == want.tobytes()


def test_integers_divide_truncating_then_scale():
    summed = np.array([7, -7, 5], np.int32)
    got = summed.copy()
    ops.finish_reduction(got, ops.ReduceOp.Average, 3.0, 2)
    assert got.tolist() == [9, -9, 6]  # trunc(7/2)=3 -> 9; trunc(-7/2)=-3 -> -9; 2 -> 6


def test_sum_applies_only_the_postscale():
    got = np.array([2.0, 4.0], np.float32)
    ops.finish_reduction(got, ops.ReduceOp.Sum, 0.5, 4)
    assert got.tolist() == [1.0, 2.0]
    same = np.array([2.0], np.float32)
    ops.finish_reduction(same, ops.ReduceOp.Max, 1.0, 4)
    assert same.tolist() == [2.0]
