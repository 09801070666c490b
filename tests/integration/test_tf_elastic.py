"""Elastic TensorFlow and Keras under the real local elastic launcher (real processes,
a worker killed with SIGKILL mid-training, a replacement joining)."""

from __future__ import annotations

import io
import os
import time

import numpy as np

from hvd_spark.runner.elastic.elastic_local import run_elastic_local

_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}


def _custom_loop(steps: int, wait_for_size: int) -> dict:
    """A TensorFlowState loop of compiled steps, traced once: ``w`` adds the average of
    (rank + 1) over the ranks; ``v`` descends 0.5 * (v - (rank + 1))**2 averaged by a
    DistributedOptimizer. Worker 1 dies right after step 12; commits every 5 steps. With
    ``wait_for_size``, steps go on until one ran with that many ranks (at most 2000: a slow
    machine's newcomer may need a minute to start TensorFlow)."""
    import signal

    import keras
    import tensorflow as tf

    import hvd_spark.tensorflow as hvd

    hvd.init()
    w = tf.Variable(tf.fill([4], float(hvd.rank()) * 100.0))  # sync makes it rank 0's
    v = tf.Variable(float(hvd.rank()) * 10.0)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5))
    opt.build([v])
    state = hvd.elastic.TensorFlowState([w, v], step=0, sizes=[])
    starts = []

    @tf.function
    def train_step():
        # Traced once, at the first ring's size; rank_op, Average and the optimizer's
        # averaging are read when it runs.
        mine = tf.cast(hvd.rank_op() + 1, tf.float32)
        w.assign_add(hvd.allreduce(mine * tf.ones([4]), op=hvd.Average, name="grad"))
        with tf.GradientTape() as tape:
            loss = 0.5 * (v - mine) ** 2
        opt.apply(tape.gradient(loss, [v]), [v])

    @hvd.elastic.run
    def train(state):
        starts.append((state.step, hvd.size()))
        while state.step < steps or (state.sizes[-1] < wait_for_size and state.step < 2000):
            train_step()
            state.step += 1
            state.sizes.append(hvd.size())
            if state.step == 12 and os.environ["HVD_SPARK_WORKER_ID"] == "1":
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step % 5 == 0:
                state.commit()
            if wait_for_size:
                time.sleep(0.05)  # leave the replacement time to start
        return w.numpy().tolist(), float(v.numpy())

    final_w, final_v = train(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "step": state.step, "starts": starts,
            "sizes": list(state.sizes), "w": final_w, "v": final_v,
            "worker": os.environ["HVD_SPARK_WORKER_ID"]}


def _predicted(sizes: list[int]) -> tuple[float, float]:
    """``w`` and ``v`` after steps at these ring sizes: the mean of 1..n is (n + 1) / 2."""
    w = v = 0.0
    for n in sizes:
        w += (n + 1) / 2
        v -= 0.5 * (v - (n + 1) / 2)
    return w, v


def test_tensorflow_state_custom_loop_survives_a_kill_and_grows_back_with_a_replacement():
    err = io.StringIO()
    results = run_elastic_local(_custom_loop, args=(20, 3), num_proc=3, min_np=2, max_np=3,
                                cooldown=0.5, start_timeout=120, env=_ENV, stderr=err)
    log = err.getvalue()
    assert [(r["rank"], r["size"], r["worker"]) for r in results] == [
        (0, 3, "0"), (1, 3, "2"), (2, 3, "3")], log
    assert "exited with code -9" in log and "started worker 3 to replace a lost one" in log
    sizes = results[0]["sizes"]
    # Steps 1-10 ran with 3 ranks; the kill after step 12 lost steps 11-12, so the
    # survivors went on from the commit at step 10 with 2 ranks, in the same trace, until
    # the replacement joined at a commit (every 5 steps) and the ring had 3 ranks again.
    grew_at = sizes.index(3, 10)
    assert sizes == [3] * 10 + [2] * (grew_at - 10) + [3] * (len(sizes) - grew_at), sizes
    assert grew_at % 5 == 0 and len(sizes) >= 20
    w, v = _predicted(sizes)
    for r in results:  # the newcomer took the state (steps, sizes, variables) from rank 0
        assert r["sizes"] == sizes and r["step"] == len(sizes)
        assert r["w"] == [w] * 4
        assert np.isclose(r["v"], v, rtol=1e-5), (r["v"], v)
    for survivor in results[:2]:
        assert survivor["starts"] == [(0, 3), (10, 2), (grew_at, 3)]
    assert results[2]["starts"] == [(grew_at, 3)]


def _keras_fit(epochs: int, wait_for_size: int) -> dict:
    """``model.fit`` with KerasState and the three callbacks; worker 1 dies in epoch 2
    (after its batch 3, before committing it). With ``wait_for_size``, training goes on
    past ``epochs`` until the ring has that many ranks again (at most 400 epochs)."""
    import signal

    import keras

    import hvd_spark.keras as hvd

    hvd.init()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 4)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [3.0], [0.5]], "float32")
    keras.utils.set_random_seed(10 + hvd.rank())  # different starting weights: sync aligns
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.006 * hvd.size(), momentum=0.5))
    model.compile(opt, "mse")
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    out: dict = {"starts": [], "epochs": [], "resets": []}

    def on_reset():  # Horovod's recipe: scale the learning rate by the new size
        out["resets"].append(hvd.size())
        model.optimizer.learning_rate.assign(0.006 * hvd.size())

    state.register_reset_callbacks([on_reset])
    worker = os.environ["HVD_SPARK_WORKER_ID"]

    class Kill(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if state.epoch == 1 and batch == 3 and worker == "1":
                os.kill(os.getpid(), signal.SIGKILL)
            if wait_for_size:
                time.sleep(0.05)  # leave the replacement time to start

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            out["epochs"].append((state.epoch, hvd.size()))
            if wait_for_size and state.epoch >= epochs and (
                    hvd.size() >= wait_for_size or state.epoch >= 400):
                self.model.stop_training = True  # the same decision on every rank

    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state), Kill(),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=1), Record()]

    @hvd.elastic.run
    def train(state):
        out["starts"].append((state.epoch, state.batch, hvd.size()))
        total = 400 if wait_for_size else epochs
        # Rank-dependent targets: the ranks agree only if every step averaged gradients.
        state.model.fit(x, y + hvd.rank(), batch_size=8, shuffle=False, verbose=0,
                        epochs=total - state.epoch, callbacks=callbacks)

    train(state)
    out.update(rank=hvd.rank(), size=hvd.size(), epoch=state.epoch, worker=worker,
               iterations=int(model.optimizer.iterations.numpy()),
               lr=float(model.optimizer.learning_rate.numpy()),
               weights=[np.asarray(w).tolist() for w in model.get_weights()])
    return out


def test_keras_fit_with_the_elastic_callbacks_finishes_all_epochs_after_a_kill():
    err = io.StringIO()
    results = run_elastic_local(_keras_fit, args=(4, 0), num_proc=3, min_np=2, max_np=3,
                                cooldown=None, start_timeout=120, env=_ENV, stderr=err)
    assert [(r["rank"], r["size"], r["epoch"]) for r in results] == [(0, 2, 4), (1, 2, 4)], (
        err.getvalue())
    first, second = results
    assert first["weights"] == second["weights"]
    assert np.isclose(first["lr"], 0.012) and np.isclose(second["lr"], 0.012)
    for r in results:
        assert r["epochs"] == [(1, 3), (2, 2), (3, 2), (4, 2)]
        assert r["resets"] == [2]
        (e0, b0, s0), (e1, b1, s1) = r["starts"]
        assert (e0, b0, s0) == (0, 0, 3)
        # Restarted in epoch 2 at the last commit (batch 2 or 3, whichever the new rank 0
        # reached); Keras runs that epoch again in full: 6 steps per epoch.
        assert (e1, s1) == (1, 2) and b1 in (2, 3), r["starts"]
        assert r["iterations"] == 6 + (b1 + 1) + 3 * 6
    assert first["starts"] == second["starts"]
    assert "exited with code -9" in err.getvalue()


def test_keras_replacement_joins_at_a_commit_and_the_ring_grows_back_to_3():
    err = io.StringIO()
    results = run_elastic_local(_keras_fit, args=(4, 3), num_proc=3, min_np=2, max_np=3,
                                cooldown=0.5, start_timeout=120, env=_ENV, stderr=err)
    assert [(r["rank"], r["size"]) for r in results] == [(0, 3), (1, 3), (2, 3)], (
        err.getvalue())
    assert "started worker 3 to replace a lost one" in err.getvalue()
    assert [r["worker"] for r in results] == ["0", "2", "3"]
    assert results[0]["weights"] == results[1]["weights"] == results[2]["weights"]
    assert len({r["iterations"] for r in results}) == 1
    assert all(np.isclose(r["lr"], 0.018) for r in results)
    assert len({r["epoch"] for r in results}) == 1 and 4 <= results[0]["epoch"] < 400
    newcomer = results[2]
    assert newcomer["resets"] == [] and len(newcomer["starts"]) == 1
    assert newcomer["starts"][0][2] == 3
    for survivor in results[:2]:
        assert survivor["resets"] == [2, 3]
        assert [s[2] for s in survivor["starts"]] == [3, 2, 3]
        assert survivor["starts"][2] == newcomer["starts"][0]  # synced from rank 0
