"""Horovod's TensorFlow/Keras names on real local ranks: each checked against a reference.

Runtime scalar ops, grouped allgather/reducescatter, in-place broadcast, IndexedSlices,
Adasum (numpy reference of the published two-vector formula), SyncBatchNormalization
(against BatchNormalization on the concatenated batch), local gradient sources,
elastic state, load_model, the learning-rate schedule and best-model checkpoint
callbacks; process sets on 3 ranks.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow  # noqa: F401 - CI installs it: never a skip

from hvd_spark.runner.local.local_launcher import run_local

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "HVD_SPARK_TIMEOUT": "60"}

# Names every Horovod TensorFlow user may reach for (and the torch binding's shared ones).
NAMES = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "Average", "Sum", "Adasum",
    "Min", "Max", "Product", "HorovodInternalError", "HostsUpdatedInterrupt", "allreduce",
    "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
    "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier",
    "broadcast_object", "broadcast_object_fn", "allgather_object", "broadcast_variables",
    "broadcast_global_variables", "rank_op", "local_rank_op", "size_op", "local_size_op",
    "process_set_included_op", "SyncBatchNormalization", "DistributedGradientTape",
    "PartialDistributedGradientTape", "DistributedOptimizer", "load_model", "Compression",
    "callbacks", "elastic",
]


def _adasum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot = float(a @ b)
    return (1 - dot / (2 * float(a @ a))) * a + (1 - dot / (2 * float(b @ b))) * b


def _parity_worker(tmp: str) -> dict:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import keras
    import tensorflow as tf

    import hvd_spark.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out: dict = {"missing": [k for k in NAMES if not hasattr(hvd, k)]}
    out["callbacks"] = [k for k in ("LearningRateScheduleCallback", "BestModelCheckpoint",
                                    "LearningRateWarmupCallback", "MetricAverageCallback",
                                    "BroadcastGlobalVariablesCallback")
                        if not hasattr(hvd.callbacks, k)]

    # Runtime scalars, eagerly and in a v1 graph.
    out["scalars_eager"] = [int(f()) for f in (hvd.rank_op, hvd.size_op, hvd.local_rank_op,
                                               hvd.local_size_op, hvd.process_set_included_op)]
    with tf.Graph().as_default():
        ops = [hvd.rank_op(), hvd.size_op(), hvd.process_set_included_op(7)]
        with tf.compat.v1.Session() as sess:
            out["scalars_graph"] = [int(v) for v in sess.run(ops)]

    # Grouped allgather and reducescatter, Horovod's positional reducescatter order.
    g = hvd.grouped_allgather([tf.fill([r + 1], r), tf.fill([1, 2], float(r))])
    out["grouped_allgather"] = [t.numpy().tolist() for t in g]
    rs = hvd.grouped_reducescatter([tf.ones([4, 2]) * (r + 1), tf.ones([2]) * 10.0],
                                   op=hvd.Sum)
    out["grouped_reducescatter"] = [t.numpy().tolist() for t in rs]
    out["reducescatter_positional"] = hvd.reducescatter(
        tf.ones([2, 1]) * (r + 1), "", hvd.Compression.none, hvd.Sum).numpy().tolist()

    # In-place broadcast of variables.
    v1, v2 = tf.Variable([float(r)] * 3), tf.Variable([[r, r]], dtype=tf.int64)
    returned = hvd.broadcast_([v1, v2], root_rank=1)
    out["broadcast_"] = [v1.numpy().tolist(), v2.numpy().tolist(), returned[0].numpy().tolist()]

    # IndexedSlices: allgathered; Average divides by size; Min is NotImplementedError.
    slices = tf.IndexedSlices(tf.constant([[1.0 + r]]), tf.constant([r]), tf.constant([2, 1]))
    avg = hvd.allreduce(slices)
    out["slices"] = [avg.values.numpy().tolist(), avg.indices.numpy().tolist()]
    mixed = hvd.grouped_allreduce([slices, tf.constant([2.0 * r])], op=hvd.Sum)
    out["mixed"] = [tf.convert_to_tensor(mixed[0]).numpy().tolist(), mixed[1].numpy().tolist()]
    try:
        hvd.allreduce(slices, op=hvd.Min)
        out["slices_min"] = "no error"
    except NotImplementedError:
        out["slices_min"] = "NotImplementedError"

    # Adasum of two different vectors.
    vec = np.array([1.0, 2.0, 3.0]) if r == 0 else np.array([-2.0, 0.5, 1.0])
    out["adasum"] = hvd.allreduce(tf.constant(vec), op=hvd.Adasum).numpy().tolist()

    # SyncBatchNormalization over both ranks' rows == BatchNormalization on all rows.
    rows = np.arange(12, dtype="float32").reshape(6, 2) ** 1.5
    mine = rows[3 * r : 3 * (r + 1)]
    sync = hvd.SyncBatchNormalization(momentum=0.5)
    plain = keras.layers.BatchNormalization(momentum=0.5)
    x_mine = tf.constant(mine)
    with tf.GradientTape() as tape:
        tape.watch(x_mine)
        y_sync = sync(x_mine, training=True)
        loss = tf.reduce_sum(y_sync * tf.constant([[1.0, 2.0]]) * (1.0 + tf.constant(mine)))
    grad_sync = tape.gradient(loss, x_mine)
    x_all = tf.constant(rows)
    with tf.GradientTape() as tape:
        tape.watch(x_all)
        y_plain = plain(x_all, training=True)
        loss = tf.reduce_sum(y_plain * tf.constant([[1.0, 2.0]]) * (1.0 + tf.constant(rows)))
    grad_plain = tape.gradient(loss, x_all)
    out["syncbn"] = [y_sync.numpy(), y_plain.numpy()[3 * r : 3 * (r + 1)],
                     sync.moving_mean.numpy(), plain.moving_mean.numpy(),
                     sync.moving_variance.numpy(), plain.moving_variance.numpy(),
                     grad_sync.numpy(), grad_plain.numpy()[3 * r : 3 * (r + 1)]]

    # Local sources keep their gradient (scaled by 1/size); others are averaged.
    w_local, w_shared = tf.Variable([1.0]), tf.Variable([1.0])
    with tf.GradientTape() as tape:
        loss = (w_local * (r + 1.0) + w_shared * (r + 1.0))[0]
    dtape = hvd.DistributedGradientTape(tape, groups=2)
    dtape.register_local_source(w_local)
    grads = dtape.gradient(loss, [w_local, w_shared])
    out["local_grads"] = [float(grads[0][0]), float(grads[1][0])]
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1), keras.layers.Dense(1)])
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(tf.ones([1, 2]) * (r + 1.0)))
    ptape = hvd.PartialDistributedGradientTape(tape, local_layers=model.layers[1])
    local, shared = ptape.get_local_and_global_gradients(loss, model.trainable_weights)
    plain_grads = tape.gradient(loss, model.trainable_weights)
    out["partial"] = [len(local), len(shared), np.allclose(local[0][1], plain_grads[2] / n)]

    # PartialDistributedOptimizer through Horovod's _compute_gradients hook: the local
    # layer's gradients are this rank's / size, the others are averaged (and not reduced
    # again by apply_gradients).
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1), keras.layers.Dense(1)])
    popt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0),
                                           local_layers=[model.layers[0]])
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(tf.ones([1, 2]) * (r + 1.0)))
    pairs = popt._compute_gradients(loss, model.trainable_weights, tape=tape)
    raw = tape.gradient(loss, model.trainable_weights)
    summed = [hvd.allreduce(g, op=hvd.Sum) for g in raw]
    before = [np.array(v) for v in model.trainable_weights]
    popt.apply_gradients(pairs)
    out["partial_opt"] = [
        bool(np.allclose(pairs[0][0], raw[0] / n)),
        bool(np.allclose(pairs[2][0], summed[2] / n)),
        bool(np.allclose(before[2] - np.array(model.trainable_weights[2]), summed[2] / n))]

    # BroadcastGlobalVariablesCallback(local_variables=...) leaves those alone.
    cb_model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(
        1, kernel_initializer=keras.initializers.Constant(float(r)),
        bias_initializer=keras.initializers.Constant(float(r)), trainable=False)])
    cb_model.compile(keras.optimizers.SGD(0.0), "mse")
    kernel = cb_model.layers[0].kernel
    cb_model.fit(np.ones((2, 2)), np.ones((2, 1)), verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(1, local_variables=[kernel])])
    out["local_bcast"] = [float(np.array(kernel)[0, 0]),
                          float(np.array(cb_model.layers[0].bias)[0])]

    # Elastic state: sync takes rank 0's, restore goes back to the last commit.
    var = tf.Variable([float(r), float(r)])
    state = hvd.elastic.TensorFlowState([var], batch=10 + r)
    state.sync()
    synced = (var.numpy().tolist(), state.batch)
    var.assign([5.0, 5.0])
    state.batch = 99
    state.restore()
    restored = (var.numpy().tolist(), state.batch)
    var.assign([7.0, 7.0])
    state.commit()
    var.assign([8.0, 8.0])
    state.restore()
    out["elastic"] = [synced, restored, var.numpy().tolist()]

    # broadcast_object_fn, join's value, and load_model wrapping a plainly saved model.
    bcast = hvd.broadcast_object_fn(root_rank=1)
    out["bcast_fn"] = [bcast({"r": r}), bcast([r])]
    path = os.path.join(tmp, f"plain{r}.keras")
    plain_model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    plain_model.compile(keras.optimizers.SGD(0.1), "mse")
    plain_model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    plain_model.save(path)
    loaded = hvd.load_model(path)
    out["load_model"] = type(loaded.optimizer).__name__

    # LearningRateScheduleCallback (staircase decay from epoch 1) and BestModelCheckpoint.
    rates = []

    class Rates(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            rates.append(float(np.array(self.model.optimizer.learning_rate)))

    sched = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    sched.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.4)), "mse")
    best = os.path.join(tmp, f"best{r}.keras")
    sched.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=4, epochs=4, verbose=0,
              validation_data=(np.ones((2, 2)), np.ones((2, 1))), callbacks=[
                  hvd.callbacks.LearningRateScheduleCallback(0.4, 0.5, start_epoch=1),
                  hvd.callbacks.BestModelCheckpoint(filepath=best), Rates()])
    out["rates"], out["best_saved"] = rates, os.path.exists(best)
    out["join"] = int(hvd.join())
    return out


def test_horovod_tensorflow_names_and_semantics(tmp_path):
    r0, r1 = run_local(_parity_worker, args=(str(tmp_path),), num_proc=2, env=ENV)
    for r, res in enumerate((r0, r1)):
        assert res["missing"] == [] and res["callbacks"] == []
        assert res["scalars_eager"] == [r, 2, r, 2, 1]
        assert res["scalars_graph"] == [r, 2, -1]
        assert res["grouped_allgather"] == [[0, 1, 1], [[0.0, 0.0], [1.0, 1.0]]]
        assert res["grouped_reducescatter"] == [[[3.0, 3.0]] * 2, [20.0]]
        assert res["reducescatter_positional"] == [[3.0]]
        assert res["broadcast_"] == [[1.0] * 3, [[1, 1]], [1.0] * 3]
        assert res["slices"] == [[[0.5], [1.0]], [0, 1]]
        assert res["mixed"] == [[[1.0], [2.0]], [2.0]]
        assert res["slices_min"] == "NotImplementedError"
        np.testing.assert_allclose(res["adasum"], _adasum(np.array([1.0, 2.0, 3.0]),
                                                          np.array([-2.0, 0.5, 1.0])))
        sync = res["syncbn"]
        for i in range(0, 8, 2):
            np.testing.assert_allclose(sync[i], sync[i + 1], rtol=1e-4, atol=1e-5)
        assert res["local_grads"] == [(r + 1.0) / 2, 1.5]
        assert res["partial"] == [2, 2, True]
        assert res["partial_opt"] == [True, True, True]
        assert res["local_bcast"] == [float(r), 1.0]  # own kernel, root 1's bias
        assert res["elastic"] == [([0.0, 0.0], 10), ([0.0, 0.0], 10), [7.0, 7.0]]
        assert res["bcast_fn"] == [{"r": 1}, [1]]
        assert res["load_model"] == "DistributedSGD"
        assert res["rates"] == pytest.approx([0.4, 0.4, 0.2, 0.1])
        assert res["best_saved"]
        assert res["join"] in (0, 1)
    assert r0["join"] == r1["join"]


def _process_set_worker() -> dict:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf

    import hvd_spark.tensorflow as hvd
    from hvd_spark.errors import HvdSparkError

    hvd.init()
    r = hvd.rank()
    evens = hvd.add_process_set([0, 2])
    out: dict = {"id": evens.process_set_id, "included": int(hvd.process_set_included_op(
        evens.process_set_id)), "size": int(hvd.size_op(evens.process_set_id))}
    if r in (0, 2):
        out["sum"] = hvd.allreduce(tf.constant([r + 1.0]), op=hvd.Sum,
                                   process_set=evens).numpy().tolist()
        out["gather"] = hvd.allgather(tf.constant([r]), process_set=evens).numpy().tolist()
        w = tf.Variable([1.0])
        with tf.GradientTape() as tape:
            loss = w[0] * (r + 1.0)
        out["tape"] = float(hvd.DistributedGradientTape(tape, process_set=evens)
                            .gradient(loss, [w])[0][0])
    else:
        try:
            hvd.allreduce(tf.constant([1.0]), process_set=evens)
            out["outside"] = "no error"
        except tf.errors.InvalidArgumentError as exc:  # Horovod's error for a non-member
            out["outside"] = exc.message
    fake = hvd.ProcessSet([0])
    fake.process_set_id = 10  # never added
    try:
        hvd.allreduce(tf.constant([1.0]), process_set=fake)
        out["fake"] = "no error"
    except HvdSparkError as exc:
        out["fake"] = f"{type(exc).__name__}: {exc}"
    # A TF1 optimizer in a v1 graph: members average over the set, others keep their own.
    with tf.Graph().as_default():
        var = tf.compat.v1.get_variable("w", initializer=[0.0], use_resource=False)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                       process_set=evens)
        step = opt.minimize(-var[0] * (r + 1.0) ** 2, var_list=[var])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(step)
            out["legacy"] = (type(opt).__name__, sess.run(var).tolist())
    out["everyone"] = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy().tolist()
    out["removed"] = hvd.remove_process_set(evens)
    return out


def test_process_sets_on_three_ranks():
    results = run_local(_process_set_worker, num_proc=3, env=ENV)
    for r, res in enumerate(results):
        assert res["id"] == results[0]["id"] != 0
        assert res["included"] == (0 if r == 1 else 1) and res["size"] == 2
        assert res["everyone"] == [3.0] and res["removed"] is True
        assert res["fake"].startswith("ConfigError") and "add_process_set" in res["fake"]
        # (1 + 9) / 2 on ranks 0 and 2; rank 1 (outside the set) keeps its own 4.
        assert res["legacy"] == ("LegacyDistributedOptimizer", [4.0 if r == 1 else 5.0])
        if r == 1:
            assert "not a member" in res["outside"]
        else:
            assert res["sum"] == [4.0] and res["gather"] == [0, 2]
            assert res["tape"] == 2.0  # (1 + 3) / 2
