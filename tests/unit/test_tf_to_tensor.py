"""Eager results become tensors through DLPack only when TensorFlow can take them."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from hvd_spark.collectives.buffers import ALIGN_BYTES, aligned_empty
from hvd_spark.tensorflow import kernel


def test_aligned_empty_is_aligned_for_any_shape():
    for shape in [(), (0,), (1,), (3, 5), (1001,)]:
        arr = aligned_empty(shape, np.float32)
        assert arr.shape == shape and arr.flags.c_contiguous
        if arr.size:  # an empty array has no data to align
            assert arr.ctypes.data % ALIGN_BYTES == 0


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_unaligned_results_are_copied_not_adopted(offset):
    # An unaligned buffer handed to TensorFlow through DLPack would abort the process on
    # the first op; to_tensor must copy it into an aligned one first.
    base = np.arange(200, dtype=np.float32)
    view = base[offset : offset + 100]
    t = kernel.to_tensor(view, tf.float32)
    np.testing.assert_array_equal((t + 1).numpy(), view + 1)
    base[offset] = -7.0  # the tensor must not see later writes to an unaligned source
    if offset:
        assert float(t[0]) == float(offset)


@pytest.mark.parametrize("dtype,tf_dtype", [
    (np.bool_, tf.bool), (ml_dtypes.bfloat16, tf.bfloat16), (np.float16, tf.float16),
    (np.int64, tf.int64), (np.uint8, tf.uint8),
])
def test_every_dtype_round_trips(dtype, tf_dtype):
    arr = np.ones((2, 3), dtype)
    t = kernel.to_tensor(arr, tf_dtype)
    assert t.dtype == tf_dtype and t.shape == (2, 3)
    np.testing.assert_array_equal(t.numpy().astype(np.float64), arr.astype(np.float64))


def test_read_only_results_are_copied():
    # A view of an input tensor is read-only, and DLPack cannot export it.
    view = np.asarray(tf.range(8, dtype=tf.float32))
    assert not view.flags.writeable
    np.testing.assert_array_equal(kernel.to_tensor(view, tf.float32).numpy(), np.arange(8))


def test_zero_d_and_empty_results():
    assert kernel.to_tensor(np.float32(2.5) * np.ones((), np.float32), tf.float32).shape == ()
    assert kernel.to_tensor(np.zeros((0, 4), np.float32), tf.float32).shape == (0, 4)


def test_gradient_wrapper_only_while_a_tape_records():
    assert not kernel.needs_gradient()
    with tf.GradientTape():
        assert kernel.needs_gradient()
