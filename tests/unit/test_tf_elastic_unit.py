"""The TensorFlow/Keras elastic pieces that need no second rank: recognising a lost rank
inside a graph, the states' commit/restore, the Keras callbacks' bookkeeping."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvd_spark.keras as hvd
from hvd_spark.errors import ConfigError, HorovodInternalError, PeerDisconnectedError
from hvd_spark.tensorflow import kernel
from hvd_spark.tensorflow.elastic import lost_peer_error


@pytest.fixture(autouse=True)
def _one_rank_job():
    """A one-rank job (no launcher) for each test, shut down before the hygiene check."""
    hvd.init()
    yield
    hvd.shutdown()


def _graph_failure(exc: Exception) -> tf.errors.OpError:
    """The error a collective raising ``exc`` inside a tf.function reaches Python as."""
    def fn(a):
        raise exc

    @tf.function
    def step(x):
        return kernel.run(fn, [x], [tf.float32])[0]

    with pytest.raises(tf.errors.OpError) as info:
        step(tf.ones(2))
    return info.value


def test_a_lost_rank_inside_a_graph_is_recognised_by_its_class_and_text():
    found = lost_peer_error(_graph_failure(PeerDisconnectedError("no data from rank 2")))
    assert type(found) is PeerDisconnectedError and "no data from rank 2" in str(found)
    found = lost_peer_error(_graph_failure(HorovodInternalError("engine stopped")))
    assert type(found) is HorovodInternalError and "engine stopped" in str(found)
    assert lost_peer_error(_graph_failure(ValueError("a bug in the step"))) is None


def test_an_eager_lost_rank_is_found_behind_another_error():
    cause = PeerDisconnectedError("rank 1 vanished")
    try:
        try:
            raise cause
        except PeerDisconnectedError as exc:
            raise RuntimeError("callback failed") from exc
    except RuntimeError as outer:
        assert lost_peer_error(outer) is cause
    assert lost_peer_error(RuntimeError("plain")) is None


def test_run_turns_a_graph_failure_into_horovod_internal_error_outside_elastic_jobs():
    failure = _graph_failure(PeerDisconnectedError("no data from rank 1"))
    state = hvd.elastic.ObjectState(step=0)

    @hvd.elastic.run
    def train(state):
        raise failure

    with pytest.raises(PeerDisconnectedError, match="no data from rank 1") as info:
        train(state)
    assert info.value.__cause__ is failure


def _model() -> keras.Model:
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), "mse")
    return model


def test_keras_state_builds_the_optimizer_and_restores_model_and_optimizer():
    model = _model()
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    names = [v.path for v in model.optimizer.variables]
    assert any("momentum" in n for n in names), names  # slots exist before any fit
    state.sync()
    before = [w.copy() for w in model.get_weights()]
    model.fit(np.ones((4, 2)), np.zeros((4, 1)), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    state.epoch = 3
    state.restore()
    assert int(model.optimizer.iterations.numpy()) == 0 and state.epoch == 0
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    model.fit(np.ones((4, 2)), np.zeros((4, 1)), verbose=0)
    state.commit()
    model.train_function = "traced"
    state.on_reset()
    assert model.train_function is None  # the next fit traces for the new ring


def test_keras_state_refuses_an_unbuilt_model_or_one_without_optimizer():
    with pytest.raises(ConfigError, match="model is not built"):
        hvd.elastic.KerasState(keras.Sequential([keras.layers.Dense(1)]))
    built = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ConfigError, match="optimizer="):
        hvd.elastic.KerasState(built)


def test_callbacks_check_their_arguments():
    state = hvd.elastic.ObjectState(epoch=0)
    with pytest.raises(ConfigError, match="batches_per_commit must be a positive integer"):
        hvd.elastic.CommitStateCallback(state, batches_per_commit=0)
    with pytest.raises(ConfigError, match="no attribute 'batch'"):
        hvd.elastic.UpdateBatchStateCallback(state)
    with pytest.raises(ConfigError, match="state must be an hvd.elastic state"):
        hvd.elastic.UpdateEpochStateCallback(object())


@pytest.mark.parametrize("style", ["epochs_left", "initial_epoch"])
def test_callbacks_count_epochs_and_batches_in_either_fit_style(style):
    model = _model()
    state = hvd.elastic.KerasState(model, epoch=2, batch=0)
    commits = []

    original = state.commit
    state.commit = lambda: (commits.append((state.epoch, state.batch)), original())[1]
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=2)]
    fit = ({"epochs": 5 - state.epoch} if style == "epochs_left"
           else {"epochs": 5, "initial_epoch": state.epoch})
    model.fit(np.ones((12, 2)), np.zeros((12, 1)), batch_size=4, verbose=0, shuffle=False,
              callbacks=callbacks, **fit)
    assert state.epoch == 5 and state.batch == 0
    # 3 batches an epoch, a commit every 2 batches (the count goes on across epochs) and
    # at every epoch end.
    assert commits[:4] == [(2, 1), (3, 0), (3, 0), (3, 2)]
    assert commits[-1] == (5, 0)


def test_size_in_a_graph_is_read_when_it_runs():

    @tf.function
    def traced():
        return kernel.size_tensor(hvd.global_process_set)

    assert isinstance(kernel.size_tensor(hvd.global_process_set), int)
    assert int(traced()) == hvd.size()
    assert isinstance(traced.get_concrete_function().structured_outputs, tf.Tensor)


def test_horovods_elastic_names_in_both_namespaces():
    import hvd_spark.tensorflow as tfhvd
    from hvd_spark.keras.elastic import KerasState, run

    names = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState",
             "KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
             "UpdateEpochStateCallback"]
    for name in names:
        assert getattr(tfhvd.elastic, name) is getattr(hvd.elastic, name), name
    assert KerasState is tfhvd.elastic.KerasState and run is tfhvd.elastic.run
    assert issubclass(KerasState, tfhvd.elastic.State)
