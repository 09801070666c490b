"""hvd_spark.tensorflow tensor collectives on 2 real local ranks, eager and in tf.function."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow  # noqa: F401 - CI installs it: never a skip

from hvd_spark.runner.local.local_launcher import run_local  # noqa: E402

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "HVD_SPARK_TIMEOUT": "60"}


def _ops_worker() -> dict:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf

    import hvd_spark.keras as hvd_keras
    import hvd_spark.tensorflow as hvd
    import hvd_spark.tensorflow.keras as hvd_tf_keras
    from hvd_spark.errors import HvdSparkError

    hvd.init()
    r = hvd.rank()
    out: dict = {"rank": r, "size": hvd.size(), "local_rank": hvd.local_rank()}
    out["aliases"] = all(
        getattr(alias, n) is getattr(hvd, n) for alias in (hvd_keras, hvd_tf_keras)
        for n in hvd.__all__)
    x = tf.constant([1.0, 2.0]) * (r + 1)
    for op in ("Average", "Sum", "Min", "Max", "Product"):
        out[f"eager_{op}"] = hvd.allreduce(x, op=getattr(hvd, op)).numpy()
    out["int_sum"] = hvd.allreduce(tf.constant([r + 1, 5]), op=hvd.Sum).numpy()
    out["fp16"] = hvd.allreduce(x, compression=hvd.Compression.fp16).numpy()

    @tf.function
    def graph_step(v):
        with tf.GradientTape() as tape:
            tape.watch(v)
            y = hvd.allreduce(v, op=hvd.Sum)
            z = hvd.allgather(tf.reshape(v[: r + 1], [-1, 1]))  # rank r sends r+1 rows
            b = hvd.broadcast(v, root_rank=1)
            loss = tf.reduce_sum(y * y) + tf.reduce_sum(z) + tf.reduce_sum(b)
        return y, z, tape.gradient(loss, v)

    for attempt in range(2):  # a traced function runs again with the same names
        y, z, g = graph_step(x)
        out[f"graph_y{attempt}"], out[f"graph_z{attempt}"] = y.numpy(), z.numpy()
        out[f"graph_grad{attempt}"] = g.numpy()
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(hvd.allreduce(x) * tf.constant([1.0, 3.0]))
    out["eager_grad"] = tape.gradient(loss, x).numpy()

    grouped = hvd.grouped_allreduce([x, tf.fill([3], float(r)), tf.constant([r], tf.int64)],
                                    op=hvd.Sum)
    out["grouped"] = [t.numpy() for t in grouped]
    recv, splits = hvd.alltoall(tf.range(4) + 10 * r, splits=[1, 3])
    out["alltoall"], out["alltoall_splits"] = recv.numpy(), splits.numpy()
    out["reducescatter"] = hvd.reducescatter(tf.ones([3, 2]) * (r + 1), op=hvd.Sum).numpy()
    var = tf.Variable(tf.ones([2, 2]) * r)
    hvd.broadcast_variables([var], root_rank=1)
    out["bcast_var"] = var.numpy()
    out["bcast_obj"] = hvd.broadcast_object({"from": r}, root_rank=1)
    out["gather_obj"] = hvd.allgather_object(r * 10)
    hvd.barrier()
    out["join"] = int(hvd.join())

    with tf.GradientTape() as tape:
        w = tf.Variable([1.0, 1.0])
        loss = tf.reduce_sum(w * w) * (r + 1)
    out["tape_grads"] = hvd.DistributedGradientTape(tape).gradient(loss, [w])[0].numpy()

    # Bad input: a shape disagreement is an error on every rank, and the job carries on.
    try:
        hvd.allreduce(tf.ones([2 + r]), name="mismatch")
        out["mismatch"] = "no error"
    except HvdSparkError as exc:
        out["mismatch"] = str(exc)
    out["after_error"] = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy()
    return out


def test_tensor_collectives_two_ranks():
    r0, r1 = run_local(_ops_worker, num_proc=2, env=ENV)
    for res in (r0, r1):
        r = res["rank"]
        assert res["size"] == 2 and res["local_rank"] == r and res["aliases"]
        np.testing.assert_allclose(res["eager_Average"], [1.5, 3.0])
        np.testing.assert_allclose(res["eager_Sum"], [3.0, 6.0])
        np.testing.assert_allclose(res["eager_Min"], [1.0, 2.0])
        np.testing.assert_allclose(res["eager_Max"], [2.0, 4.0])
        np.testing.assert_allclose(res["eager_Product"], [2.0, 8.0])
        np.testing.assert_array_equal(res["int_sum"], [3, 10])
        np.testing.assert_allclose(res["fp16"], [1.5, 3.0])
        for attempt in range(2):
            np.testing.assert_allclose(res[f"graph_y{attempt}"], [3.0, 6.0])
            np.testing.assert_allclose(res[f"graph_z{attempt}"], [[1.0], [2.0], [4.0]])
        # d/dx: Sum-allreduce of 2y (=4y); allgathered rows get the rank-averaged
        # gradient (1 per sent row) and the broadcast's averaged gradient reaches root 1
        # only, as in Horovod.
        expect = np.array([12.0, 24.0]) + np.array([1.0, 1.0 * r]) + (1.0 if r == 1 else 0.0)
        np.testing.assert_allclose(res["graph_grad0"], expect)
        np.testing.assert_allclose(res["graph_grad1"], expect)
        np.testing.assert_allclose(res["eager_grad"], [1.0, 3.0])
        np.testing.assert_allclose(res["grouped"][0], [3.0, 6.0])
        np.testing.assert_allclose(res["grouped"][1], [1.0, 1.0, 1.0])
        np.testing.assert_array_equal(res["grouped"][2], [1])
        np.testing.assert_array_equal(res["alltoall_splits"], [1, 1] if r == 0 else [3, 3])
        np.testing.assert_allclose(res["reducescatter"], np.full((2 - r, 2), 3.0))
        np.testing.assert_allclose(res["bcast_var"], np.ones([2, 2]))
        assert res["bcast_obj"] == {"from": 1} and res["gather_obj"] == [0, 10]
        assert res["join"] in (0, 1) and res["join"] == r0["join"]  # the last to join
        np.testing.assert_allclose(res["tape_grads"], [3.0, 3.0])
        assert "mismatch" in res["mismatch"] and "shape" in res["mismatch"]
        np.testing.assert_allclose(res["after_error"], [2.0])
    np.testing.assert_array_equal(r0["alltoall"], [0, 10])
    np.testing.assert_array_equal(r1["alltoall"], [1, 2, 3, 11, 12, 13])


def _large_float16_worker(asynchronous: bool) -> dict:
    """Large float16 allreduces, which TensorFlow's registered kernels reduce (counted per
    case): eagerly, inside tf.function (a numpy_function callback), in a TF1 session (its
    callbacks run eagerly too) and through fp16 compression. ``asynchronous``: eager
    execution is asynchronous on every thread (set before the runtime starts), where the
    kernels must decline: their op would queue behind the very function whose callback
    runs it, and wait for ever."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf

    import hvd_spark.tensorflow as hvd
    from hvd_spark.collectives import ops
    from tests.integration.collective_jobs import count_tensorflow_half_kernels

    taken: list[bool] = []
    count_tensorflow_half_kernels(taken)
    if asynchronous:
        tf.config.experimental.set_synchronous_execution(False)
    hvd.init()
    r = hvd.rank()
    n = 3 * 65536 + 5  # several shared-memory chunks and an odd tail
    x = np.random.default_rng(r).standard_normal(n).astype(np.float16)
    out: dict = {"kernels": ops.half_kernels_name(), "x": x}

    def case(key, run):
        taken.clear()
        out[key] = run()
        out[f"{key}_taken"] = sum(taken)

    case("eager", lambda: hvd.allreduce(tf.constant(x), op=hvd.Sum, name="f16.eager").numpy())
    case("average", lambda: hvd.allreduce(tf.constant(x), op=hvd.Average,
                                          name="f16.avg").numpy())
    fn = tf.function(lambda v: hvd.allreduce(v, op=hvd.Sum, name="f16.fn"))
    case("function", lambda: fn(tf.constant(x)).numpy())
    x32 = x.astype(np.float32)
    case("fp16", lambda: hvd.allreduce(tf.constant(x32), op=hvd.Sum, name="f16.comp",
                                       compression=hvd.Compression.fp16).numpy())
    graph = tf.Graph()
    with graph.as_default():
        node = hvd.allreduce(tf.constant(x), op=hvd.Sum, name="f16.session")
    with tf.compat.v1.Session(graph=graph) as session:
        case("session", lambda: session.run(node))
    return out


KEYS = ("eager", "average", "function", "fp16", "session")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_large_float16_allreduce_with_tensorflow_kernels(asynchronous):
    a, b = run_local(_large_float16_worker, args=(asynchronous,), num_proc=2, env=ENV)
    assert a["kernels"] == b["kernels"] == "tensorflow"
    want = (a["x"].astype(np.float32) + b["x"].astype(np.float32)).astype(np.float16)
    avg = (want.astype(np.float32) * np.float32(0.5)).astype(np.float16)
    for out in (a, b):
        for key in ("eager", "function", "session"):
            assert out[key].dtype == np.float16, key
            assert out[key].tobytes() == want.tobytes(), key
        assert out["average"].tobytes() == avg.tobytes()
        assert out["fp16"].dtype == np.float32
        np.testing.assert_array_equal(out["fp16"], want.astype(np.float32))
    # Each rank reduces its share of the ring (or both halves when two ranks decide alone).
    taken = {key: a[f"{key}_taken"] + b[f"{key}_taken"] for key in KEYS}
    assert taken == dict.fromkeys(KEYS, 0) if asynchronous else all(taken.values()), taken
