"""float16/bfloat16 reductions and scaling: float32 arithmetic, rounded once per step.

Every case runs with numpy's kernels and with the torch and TensorFlow bindings'
registered ones (TensorFlow's take large float16 arrays only), and compares bitwise with a
float32 numpy reference rounded once (NaN: position only, the payload is not part of the
contract).
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import ml_dtypes
import numpy as np
import pytest

from hvd_spark.collectives import ops
from hvd_spark.torch import half_kernels

# Overflow and inf - inf warn as they do for float32; the values are what is tested.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

HALF_DTYPES = [np.dtype(np.float16), ops.BFLOAT16]
REF_UFUNCS = {ops.Sum: np.add, ops.Average: np.add, ops.Min: np.minimum,
              ops.Max: np.maximum, ops.Product: np.multiply}
REDUCE_OPS = list(REF_UFUNCS)
C = ops.HALF_CHUNK
SIZES = [0, 1, 7, C - 1, C, 2 * C + 3, (1 << 15) + 1]


@pytest.fixture(params=["numpy", "torch", "tensorflow"])
def kernels(request):
    """Runs the test with numpy's kernels, then with torch's registered, then TensorFlow's
    (which take float16 arrays of ``tf_half_kernels.MIN_ELEMENTS`` or more)."""
    if request.param == "torch":
        previous = ops.register_half_kernels(half_kernels.KERNELS)
    elif request.param == "tensorflow":
        previous = ops.register_half_kernels(_started_tf_kernels())
    else:
        previous = ops.register_half_kernels(None)
    assert ops.half_kernels_name() == request.param
    yield request.param
    ops.register_half_kernels(previous)


def _started_tf_kernels() -> ops.HalfKernels:
    """TensorFlow's kernels, with its runtime started (before that they decline)."""
    import tensorflow as tf

    from hvd_spark.tensorflow import half_kernels as tf_half_kernels

    tf.constant(0.0).numpy()
    return tf_half_kernels.KERNELS


def _printed_by(code: str) -> list[str]:
    """The words ``code`` prints in a fresh interpreter (import-time effects need one)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True).stdout.split()


def _specials(dtype: np.dtype) -> np.ndarray:
    info = ml_dtypes.finfo(dtype)
    return np.array([0.0, -0.0, np.inf, -np.inf, np.nan, float(info.max), -float(info.max),
                     float(info.smallest_subnormal), -float(info.smallest_subnormal),
                     float(info.smallest_normal), 1.0, -1.0, 3.0, 1e-3], dtype)


def _random(rng: np.random.Generator, shape, dtype: np.dtype) -> np.ndarray:
    """Every bit pattern of the dtype is fair game (NaNs, infinities, subnormals)."""
    return rng.integers(0, 1 << 16, shape, dtype=np.uint16).view(dtype)


def _pairs(dtype: np.dtype, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a, b = _random(rng, n, dtype), _random(rng, n, dtype)
    # Specials against each other and against ordinary values, near the start.
    sp = _specials(dtype)
    k = min(n, sp.size * sp.size)
    a[:k] = np.repeat(sp, sp.size)[:k]
    b[:k] = np.tile(sp, sp.size)[:k]
    return a, b


def _ref_reduce(a: np.ndarray, b: np.ndarray, op: ops.ReduceOp) -> np.ndarray:
    with np.errstate(all="ignore"):
        return REF_UFUNCS[op](a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)


def _ref_scale(a: np.ndarray, factor: float) -> np.ndarray:
    with np.errstate(all="ignore"):
        return (a.astype(np.float32) * np.float32(factor)).astype(a.dtype)


def assert_same_bits(got: np.ndarray, want: np.ndarray, zero_sign: bool = True) -> None:
    """Bitwise equal, except that NaNs only need to sit at the same positions.

    ``zero_sign=False`` (Min/Max): min(+0, -0) may be either zero. IEEE 754 leaves it
    open, and numpy's float16 and float32 loops and torch's vector and scalar ones
    differ; each element is still computed on one rank, so ranks agree bitwise.
    """
    assert got.dtype == want.dtype and got.shape == want.shape
    g32, w32 = got.astype(np.float32), want.astype(np.float32)
    nan = np.isnan(w32)
    np.testing.assert_array_equal(np.isnan(g32), nan)
    if not zero_sign:
        got, want = got.copy(), want.copy()
        got[g32 == 0] = 0
        want[w32 == 0] = 0
    g, w = got.view(np.uint16)[~nan], want.view(np.uint16)[~nan]
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, (f"{bad.size} elements differ, first at {bad[0]}: "
                           f"{got[~nan][bad[0]]!r} != {want[~nan][bad[0]]!r}")


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("op", REDUCE_OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("with_base", [False, True], ids=["in_place", "base"])
def test_reduce_rounds_once_from_float32(kernels, dtype, op, n, with_base):
    a, b = _pairs(dtype, n, seed=n)
    want = _ref_reduce(a, b, op)
    a_before, b_before = a.copy(), b.copy()
    if with_base:
        dst = np.full(n, 7, dtype)
        ops.reduce_into(dst, b, op, a)
        assert a.tobytes() == a_before.tobytes()
    else:
        dst = a
        ops.reduce_into(dst, b, op)
    assert b.tobytes() == b_before.tobytes()
    assert_same_bits(dst, want, zero_sign=op not in (ops.Min, ops.Max))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("op", REDUCE_OPS, ids=lambda o: o.name)
def test_reduce_zero_d_and_shaped(kernels, dtype, op):
    a = np.array(1.5, dtype)
    ops.reduce_into(a, np.array(-0.25, dtype), op)
    assert a.shape == () and a.dtype == dtype
    assert_same_bits(a, _ref_reduce(np.array(1.5, dtype), np.array(-0.25, dtype), op))
    x, y = (v.reshape(3, 5, 7) for v in _pairs(dtype, 105, seed=3))
    want = _ref_reduce(x, y, op)
    ops.reduce_into(x, y, op)
    assert_same_bits(x, want, zero_sign=op not in (ops.Min, ops.Max))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_strided_and_read_only_arrays_fall_back_correctly(kernels, dtype):
    a, b = _pairs(dtype, 3 * C + 1, seed=5)
    want = _ref_reduce(a[::3], b[::3], ops.Sum)
    dst = a[::3]
    ops.reduce_into(dst, b[::3], ops.Sum)  # strided: never handed to a kernel
    assert_same_bits(dst, want)
    a, b = _pairs(dtype, C + 5, seed=6)
    want = _ref_reduce(a, b, ops.Product)
    b.flags.writeable = False  # torch.from_numpy would warn about it
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        ops.reduce_into(a, b, ops.Product)
    assert_same_bits(a, want)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("factor", [0.5, 1 / 3, 1 / 7, 3.7, 1e-8, 70000.0, -2.0])
@pytest.mark.parametrize("n", [0, 1, C + 3])
def test_scale_in_place_rounds_once(kernels, dtype, factor, n):
    a = _pairs(dtype, n, seed=11)[0]
    want = _ref_scale(a, factor)
    ops.scale_in_place(a, factor)
    assert_same_bits(a, want)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("size", [2, 3, 8])
def test_average_is_sum_then_one_scaling(kernels, dtype, size):
    x = _pairs(dtype, 9 * (C // 4 + 1), seed=size)[0].reshape(-1, 9)
    want = _ref_scale(x, 1.0 / size)
    ops.finish_average(x, size)
    assert_same_bits(x, want)
    strided = _pairs(dtype, 30, seed=1)[0][::2]
    want = _ref_scale(strided, 1.0 / size)
    ops.finish_average(strided, size)
    assert_same_bits(strided, want)


def test_zero_d_scale_and_empty(kernels):
    z = np.array(3.0, np.float16)
    ops.scale_in_place(z, 0.25)
    assert z.shape == () and float(z) == 0.75
    e = np.zeros((0, 4), ops.BFLOAT16)
    ops.reduce_into(e, e.copy(), ops.Sum)
    ops.scale_in_place(e, 0.5)
    assert e.shape == (0, 4)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_binding_kernels_match_numpy_bitwise(dtype):
    a, b = _pairs(dtype, 5 * C + 11, seed=42)
    results = {}
    for name, k in (("numpy", None), ("torch", half_kernels.KERNELS),
                    ("tensorflow", _started_tf_kernels())):
        previous = ops.register_half_kernels(k)
        try:
            got = {}
            for op in REDUCE_OPS:
                dst = a.copy()
                ops.reduce_into(dst, b, op)
                got[op] = dst
            for factor in (0.5, 1 / 3, 0.1):
                s = a.copy()
                ops.scale_in_place(s, factor)
                got[factor] = s
        finally:
            ops.register_half_kernels(previous)
        results[name] = got
    for other in ("torch", "tensorflow"):
        for key, want in results["numpy"].items():
            # Sum/Average and scaling: the same bits (NaN payloads aside: torch makes every
            # bfloat16 NaN 0x7fc0, ml_dtypes keeps the payload).
            assert_same_bits(results[other][key], want, zero_sign=key not in (ops.Min, ops.Max))
        if dtype == np.float16 and other == "torch":  # TensorFlow's NaNs carry other payloads
            for key in (ops.Sum, ops.Average, 0.5, 1 / 3, 0.1):
                assert results[other][key].tobytes() == results["numpy"][key].tobytes(), key


def test_tensorflow_kernels_take_large_float16_only():
    import tensorflow as tf

    from hvd_spark.tensorflow import half_kernels as k

    _started_tf_kernels()
    big = max(k.MIN_ELEMENTS, k.MIN_SCALE_ELEMENTS)
    f16 = np.ones(k.SLICE + big, np.float16)  # two slices
    assert k.reduce(f16, f16.copy(), ops.Sum, f16)
    assert f16[0] == f16[-1] == 2.0 and k.scale(f16, 0.25) and f16[0] == f16[-1] == 0.5
    small = np.ones(k.MIN_ELEMENTS - 1, np.float16)
    bf16 = np.ones(big, ops.BFLOAT16)
    declined = [
        k.reduce(small, small.copy(), ops.Sum, small),
        k.scale(np.ones(k.MIN_SCALE_ELEMENTS - 1, np.float16), 0.5),
        k.reduce(bf16, bf16.copy(), ops.Sum, bf16),
        k.scale(bf16, 0.5),
        k.reduce(f16, f16.copy(), ops.Adasum, f16),
        k.scale(f16, 1e-39),  # a float32 subnormal: TensorFlow would flush it to zero
    ]
    with tf.Graph().as_default():  # graph mode: TensorFlow would build nodes instead
        declined.append(k.reduce(f16, f16.copy(), ops.Sum, f16))
    tf.config.experimental.set_synchronous_execution(False)
    try:  # asynchronous eager ops could queue behind the tf.function calling this
        declined.append(k.reduce(f16, f16.copy(), ops.Sum, f16))
    finally:
        tf.config.experimental.set_synchronous_execution(True)
    assert declined == [False] * 8
    assert small[0] == 1.0 and bf16[0] == 1.0 and f16[0] == 0.5


def test_tensorflow_kernels_wait_for_the_runtime_to_start():
    # A fresh process: reductions before any TensorFlow op leave its runtime alone, so the
    # user can still configure its thread pools (and, on a GPU build, its devices).
    code = (
        "import numpy as np, tensorflow as tf, hvd_spark.tensorflow as hvd\n"
        "from hvd_spark.collectives import ops\n"
        "hvd.init()\n"  # registers the kernels, and must not start the runtime either
        "from hvd_spark.tensorflow import half_kernels as k\n"
        "a = np.ones(1 << 16, np.float16)\n"
        "before = k.reduce(a, a.copy(), ops.Sum, a)\n"
        "ops.reduce_into(a, a.copy(), ops.Sum); ops.scale_in_place(a, 0.5)\n"
        "tf.config.threading.set_inter_op_parallelism_threads(1)\n"
        "tf.constant(1.0).numpy()\n"
        "after = k.reduce(a, a.copy(), ops.Sum, a)\n"
        "print(ops.half_kernels_name(), before, after, float(a[0]))\n"
        "hvd.shutdown()\n")
    assert _printed_by(code) == ["tensorflow", "False", "True", "2.0"]


def test_a_kernel_may_decline_and_numpy_takes_over():
    calls = []

    def reduce(dst, src, op, base):
        calls.append(("reduce", dst.shape, src.flags.c_contiguous, base.ndim))
        return False

    def scale(arr, factor):
        calls.append(("scale", arr.shape, factor))
        return False

    previous = ops.register_half_kernels(ops.HalfKernels("decliner", reduce, scale))
    try:
        assert ops.half_kernels_name() == "decliner"
        a = np.full((4, 5), 1.5, np.float16)
        ops.reduce_into(a, np.full((4, 5), 0.25, np.float16), ops.Sum)
        ops.scale_in_place(a, 2.0)
        ops.scale_in_place(a, 1.0)  # no-op: no call
        ops.reduce_into(np.ones(3, np.float32), np.ones(3, np.float32), ops.Sum)  # not half
    finally:
        assert ops.register_half_kernels(previous).name == "decliner"
    assert a.tolist() == [[3.5] * 5] * 4
    # Kernels see flat contiguous arrays only.
    assert calls == [("reduce", (20,), True, 1), ("scale", (20,), 2.0)]


def test_the_torch_bindings_init_registers_its_kernels_importing_does_not():
    code = ("from hvd_spark.collectives import ops; import hvd_spark.torch as hvd; "
            "a = ops.half_kernels_name(); hvd.init(); b = ops.half_kernels_name(); "
            "ops.register_half_kernels(None); hvd.init(); "
            "print(a, b, ops.half_kernels_name()); hvd.shutdown()")
    # Once per process: a second init leaves the choice made since alone.
    assert _printed_by(code) == ["numpy", "torch", "numpy"]
    import hvd_spark.torch.half_kernels as half_kernels

    previous = ops.register_half_kernels(None)
    try:
        half_kernels.register()
        assert ops.half_kernels_name() == "torch"
        half_kernels.unregister()
        assert ops.half_kernels_name() == "numpy"
    finally:
        ops.register_half_kernels(previous)


def test_the_tensorflow_bindings_init_registers_its_kernels_unless_torch_did():
    code = ("import sys; from hvd_spark.collectives import ops; "
            "import hvd_spark.tensorflow as tf_hvd, hvd_spark.torch as torch_hvd; "
            "a = ops.half_kernels_name(); "
            "tf_hvd.init(); b = ops.half_kernels_name(); "
            "torch_hvd.init(); c = ops.half_kernels_name(); "
            "ops.register_half_kernels(None); import hvd_spark.tensorflow.half_kernels as k; "
            "ops.register_half_kernels(ops.HalfKernels('other', None, None)); k.register(); "
            "d = ops.half_kernels_name(); k.unregister(); print(a, b, c, d, "
            "ops.half_kernels_name()); tf_hvd.shutdown()")
    assert _printed_by(code) == ["numpy", "tensorflow", "torch", "other", "other"]


def test_torch_first_then_tensorflow_keeps_torchs_kernels():
    code = ("from hvd_spark.collectives import ops; "
            "import hvd_spark.torch as torch_hvd, hvd_spark.tensorflow as tf_hvd; "
            "torch_hvd.init(); tf_hvd.init(); print(ops.half_kernels_name()); "
            "torch_hvd.shutdown()")
    assert _printed_by(code) == ["torch"]


def test_float32_path_unchanged():
    a = np.arange(10, dtype=np.float32)
    dst = np.empty_like(a)
    ops.reduce_into(dst, a, ops.Max, np.full(10, 4.5, np.float32))
    assert dst.tolist() == [4.5] * 5 + [5.0, 6.0, 7.0, 8.0, 9.0]
