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


_ALL_DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.int32,
               np.int64, np.uint8, np.uint64, np.bool_]


@pytest.mark.parametrize("dtype", _ALL_DTYPES)
@pytest.mark.parametrize("op", [ops.ReduceOp.Sum, ops.ReduceOp.Average, ops.ReduceOp.Min,
                                ops.ReduceOp.Max, ops.ReduceOp.Product])
@pytest.mark.parametrize("postscale", [1.0, 0.3])
def test_a_plain_reduction_gives_reduce_rows_bits(dtype, op, postscale):
    """Where ``plain_reduction`` offers one ufunc and a scale (the express path calls
    numpy with them), the result is bit for bit ``reduce_rows``'s; elsewhere it offers
    nothing and the caller runs ``reduce_rows`` itself."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_ and (op == ops.ReduceOp.Average or postscale != 1.0):
        return  # refused before any reduction (check_reduction)
    rng = np.random.default_rng(7)
    a, b = (rng.integers(0, 50, 37).astype(np.float64) * 0.37).astype(dtype), \
        (rng.integers(0, 50, 37).astype(np.float64) * 1.13).astype(dtype)
    want = ops.reduce_rows([a, b], op, postscale, out=np.empty(37, dtype))
    plan = ops.plain_reduction(dtype, op, postscale, 2)
    half_or_scaled_int = dtype in (np.float16, ops.BFLOAT16) or (
        not ops.is_floating(dtype) and (op == ops.ReduceOp.Average or postscale != 1.0))
    assert (plan is None) == half_or_scaled_int, plan
    if plan is None:
        return
    ufunc, factor = plan
    got = np.empty(37, dtype)
    ufunc(a, b, out=got)
    if factor is not None:
        np.multiply(got, factor, out=got, casting="unsafe")
    assert got.tobytes() == want.tobytes()


def test_adasum_has_no_plain_reduction():
    assert ops.plain_reduction(np.dtype(np.float32), ops.ReduceOp.Adasum, 1.0, 2) is None
