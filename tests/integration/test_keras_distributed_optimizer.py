"""DistributedOptimizer and callbacks under model.fit (compiled), on 2 real local ranks."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow  # noqa: F401 - CI installs it: never a skip

from hvd_spark.runner.local.local_launcher import run_local  # noqa: E402

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "HVD_SPARK_TIMEOUT": "60"}
GLOBAL_BATCH, ROWS, EPOCHS = 16, 64, 2


def _data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1).astype("float32")
    return x, y


def _half_of_every_batch(arr, rank, size):
    per = GLOBAL_BATCH // size
    return np.concatenate([arr[b + rank * per : b + (rank + 1) * per]
                           for b in range(0, len(arr), GLOBAL_BATCH)])


def _optimizers():
    import keras

    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=3, decay_rate=0.7)
    return {"sgd": keras.optimizers.SGD(0.1, momentum=0.9), "adam": keras.optimizers.Adam(schedule)}


def _fit(opt, x, y, batch, seed, callbacks=()):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(opt, "mse")  # default: compiled train_function, not run_eagerly
    history = model.fit(x, y, batch_size=batch, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return model, history


def _weights(model):
    return [np.array(v) for v in model.variables + model.optimizer.variables]


def _training_worker(tmp: str) -> dict:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import keras

    import hvd_spark.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = _data()
    xs, ys = _half_of_every_batch(x, r, n), _half_of_every_batch(y, r, n)
    out: dict = {"rank": r}
    for key, opt in _optimizers().items():
        model, _ = _fit(hvd.DistributedOptimizer(opt), xs, ys, GLOBAL_BATCH // n, seed=0)
        out[key] = _weights(model)
        if r == 0:  # the reference: one process fitting on the full batches
            ref, _ = _fit(_optimizers()[key], x, y, GLOBAL_BATCH, seed=0)
            out[f"{key}_ref"] = _weights(ref)
        if key == "adam":  # the optimizer saves and loads with the model, and keeps training
            path = os.path.join(tmp, f"model{r}.keras")
            model.save(path)
            loaded = keras.models.load_model(path)
            out["loaded_class"] = type(loaded.optimizer).__name__
            out["loaded_same"] = all(np.array_equal(a, b) for a, b in
                                     zip(_weights(loaded), _weights(model)))
            loaded.fit(xs, ys, batch_size=GLOBAL_BATCH // n, epochs=1, verbose=0, shuffle=False)
            out["loaded_after"] = _weights(loaded)

    # Different random initial weights on each rank: the callback makes them rank 0's.
    seen: dict = {}

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0 and "first" not in seen:
                seen["first"] = [np.array(v) for v in self.model.variables]

        def on_epoch_end(self, epoch, logs=None):
            seen.setdefault("local", []).append(dict(logs))

    keras.utils.set_random_seed(100 + r)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16), keras.layers.Dense(1)])
    out["init"] = [np.array(v) for v in model.variables]
    model.compile(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), "mse")
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), Record(),
                 hvd.callbacks.MetricAverageCallback()]
    history = model.fit(xs, ys, batch_size=GLOBAL_BATCH // n, epochs=EPOCHS, verbose=0,
                        shuffle=False, callbacks=callbacks)
    out["bcast_first"], out["bcast_final"] = seen["first"], _weights(model)
    out["local_logs"], out["history"] = seen["local"], history.history

    # backward_passes_per_step=2 on half batches: as in Horovod, the update uses the SUM
    # of the 2 accumulated (rank-averaged) gradients, i.e. one process on batches 4x as
    # large with twice the learning rate; average_aggregated_gradients=True uses the mean.
    for key, average in (("bpps", False), ("bpps_avg", True)):
        model, _ = _fit(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                 backward_passes_per_step=2,
                                                 average_aggregated_gradients=average,
                                                 compression=hvd.Compression.fp16),
                        xs, ys, GLOBAL_BATCH // n, seed=0)
        out[key] = [np.array(v) for v in model.variables]
        if r == 0:
            ref, _ = _fit(keras.optimizers.SGD(0.1 if average else 0.2), x, y,
                          2 * GLOBAL_BATCH, seed=0)
            out[f"{key}_ref"] = [np.array(v) for v in ref.variables]

    # Warmup: the rate ramps from lr/size to lr over 1 epoch of 4 batches.
    rates = []

    class Rates(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            rates.append(float(np.array(self.model.optimizer.learning_rate)))

    warm_opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.4, momentum=0.9))
    _fit(warm_opt, xs, ys, GLOBAL_BATCH // n, seed=0, callbacks=[
        hvd.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=1), Rates()])
    out["rates"] = rates
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One 2-rank job runs every check of this module (TF costs ~5 s per process)."""
    tmp = tmp_path_factory.mktemp("keras")
    return run_local(_training_worker, args=(str(tmp),), num_proc=2, env=ENV)


def test_two_ranks_match_one_process_on_full_batches(results):
    r0, r1 = results
    for key in ("sgd", "adam"):
        assert len(r0[key]) == len(r0[f"{key}_ref"]) > 4
        for got, ref in zip(r0[key], r0[f"{key}_ref"]):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=key)
        for a, b in zip(r0[key], r1[key]):
            np.testing.assert_array_equal(a, b)  # bitwise identical across ranks
    for res in (r0, r1):
        assert res["loaded_class"] == "DistributedAdam" and res["loaded_same"]
    for a, b in zip(r0["loaded_after"], r1["loaded_after"]):
        np.testing.assert_array_equal(a, b)


def test_broadcast_and_metric_average_callbacks(results):
    r0, r1 = results
    assert not np.array_equal(r0["init"][0], r1["init"][0])  # really different inits
    for a, b, c in zip(r0["init"], r0["bcast_first"], r1["bcast_first"]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    for a, b in zip(r0["bcast_final"], r1["bcast_final"]):
        np.testing.assert_array_equal(a, b)  # model and optimizer state
    for epoch in range(EPOCHS):
        mean = (r0["local_logs"][epoch]["loss"] + r1["local_logs"][epoch]["loss"]) / 2
        assert r0["local_logs"][epoch]["loss"] != r1["local_logs"][epoch]["loss"]
        for res in (r0, r1):
            assert res["history"]["loss"][epoch] == pytest.approx(mean, rel=1e-12)


def test_backward_passes_per_step_and_fp16(results):
    r0, r1 = results
    for key in ("bpps", "bpps_avg"):
        for got, ref in zip(r0[key], r0[f"{key}_ref"]):
            np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-4)  # fp16 on the wire
        for a, b in zip(r0[key], r1[key]):
            np.testing.assert_array_equal(a, b)
    # The two semantics really differ (sum = twice the step of the mean).
    assert not np.allclose(r0["bpps"][0], r0["bpps_avg"][0], rtol=1e-3)


def test_learning_rate_warmup(results):
    for res in results:
        expect = [0.4 / 2 * (b / 4 + 1) for b in range(4)] + [0.4] * 4
        np.testing.assert_allclose(res["rates"], expect, rtol=1e-6)
