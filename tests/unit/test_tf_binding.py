"""hvd_spark.tensorflow pieces that need no peers: names, validation, grouping, errors."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf  # CI installs it: a missing package is a failure, not a skip

import hvd_spark.tensorflow as hvd
from hvd_spark.errors import CollectiveArgumentError, CollectiveError, ConfigError
from hvd_spark.tensorflow import kernel
from hvd_spark.tensorflow.gradients import GradientReducer


def _graph_names() -> list[str]:
    with tf.Graph().as_default():
        names = [kernel.graph_name("allreduce", None) for _ in range(3)]
        names.append(kernel.graph_name("allgather", "mine"))
    return names


def test_graph_names_are_fixed_at_build_time_and_equal_for_equal_graphs():
    first, second = _graph_names(), _graph_names()  # as two ranks build the same graph
    assert first == second == ["hvd_allreduce", "hvd_allreduce_1", "hvd_allreduce_2", "mine"]
    assert kernel.graph_name("allreduce", None) is None  # eager: the core numbers the calls


def test_argument_disagreement_is_horovods_failed_precondition_and_ours():
    err = kernel.as_tf_error(CollectiveArgumentError("allreduce 'x': rank 1 has shape [3]"))
    assert isinstance(err, tf.errors.FailedPreconditionError)
    assert isinstance(err, CollectiveError) and "rank 1 has shape" in str(err)


def test_gradient_groups():
    todo = list(range(5))
    assert GradientReducer("t")._split(todo, [None] * 5) == [todo]
    assert GradientReducer("t", groups=2)._split(todo, [None] * 5) == [[0, 1, 2], [3, 4]]
    variables = [tf.Variable(float(i)) for i in range(5)]
    reducer = GradientReducer("t", groups=[[variables[4], variables[0]], [variables[2]]])
    assert reducer._split(todo, variables) == [[0, 4], [2], [1, 3]]
    with pytest.raises(ConfigError, match="groups"):
        GradientReducer("t", groups="two")
    with pytest.raises(ConfigError, match="Average, Sum or Adasum"):
        GradientReducer("t", op=hvd.Max)


def test_local_sources_are_recognised():
    local, shared = tf.Variable(1.0), tf.Variable(2.0)
    reducer = GradientReducer("t")
    reducer.register_local_source(local)
    assert reducer.is_local(local) and not reducer.is_local(shared)


def test_distributed_optimizer_settings_and_config():
    with pytest.raises(ConfigError, match="num_groups or groups"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), num_groups=2, groups=3)
    with pytest.raises(ConfigError, match="op=Average"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    with pytest.raises(ConfigError, match="Keras 3 optimizer"):
        hvd.DistributedOptimizer(object())
    with pytest.raises(ConfigError, match="backward_passes_per_step > 1 needs a Keras"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                 backward_passes_per_step=2)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=3,
                                   average_aggregated_gradients=True, groups=2,
                                   op=hvd.Adasum)
    config = opt.get_config()
    assert config["gradient_accumulation_steps"] == 3
    assert config["hvd_spark"]["average_aggregated_gradients"] is True
    assert config["hvd_spark"]["groups"] == 2 and config["hvd_spark"]["op"] == int(hvd.Adasum)
    assert type(opt).from_config(config).get_config() == config
    # The variables an apply sees are kept out of the optimizer's own (saved) variables.
    model_vars = [tf.Variable([1.0]), tf.Variable([2.0])]
    opt.build(model_vars)
    before = len(opt.variables)
    opt._hvd_seen.variables = model_vars
    assert len(opt.variables) == before


def test_loss_scale_optimizer_refuses_accumulation_around_a_distributed_one():
    """A rank whose accumulated gradients overflow would skip the allreduce alone."""
    opt = keras.mixed_precision.LossScaleOptimizer(
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2))
    with pytest.raises(ConfigError, match="backward_passes_per_step > 1 is not supported"):
        opt.apply([keras.ops.ones((2,))], [keras.Variable([1.0, 2.0])])
    plain = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    var = keras.Variable([1.0, 2.0])
    plain.apply([keras.ops.ones((2,)) * plain.initial_scale], [var])  # unchanged elsewhere
    np.testing.assert_allclose(np.asarray(var), [0.9, 1.9], rtol=1e-6)


def test_callbacks_validate_their_settings():
    with pytest.raises(ConfigError, match="filepath"):
        hvd.callbacks.BestModelCheckpoint().on_train_begin()
    decay = hvd.callbacks.LearningRateScheduleCallback(1.0, 0.5, start_epoch=2)
    assert decay.multiplier(2) == 1.0 and decay.multiplier(4) == 0.25


def test_sync_batch_norm_alone_is_batch_norm():
    x = tf.constant(np.arange(8, dtype="float32").reshape(4, 2))
    sync, plain = hvd.SyncBatchNormalization(fused=False), keras.layers.BatchNormalization()
    np.testing.assert_allclose(sync(x, training=True), plain(x, training=True), rtol=1e-6)


def _node_types_of_a_traced_collective() -> set[str]:
    fn = tf.function(lambda x: kernel.run(lambda a: [a * 2], [x], [tf.float32]))
    graph = fn.get_concrete_function(tf.TensorSpec([2], tf.float32)).graph
    return {"PyFunc" if "PyFunc" in op.type else op.type for op in graph.get_operations()}


def test_functions_traced_off_the_main_thread_get_deadlock_free_nodes():
    import threading

    on_main = _node_types_of_a_traced_collective()
    assert "PyFunc" in on_main and "DatasetToSingleElement" not in on_main
    seen: dict = {}
    thread = threading.Thread(
        target=lambda: seen.update(types=_node_types_of_a_traced_collective()))
    thread.start()
    thread.join(60)
    # Other threads may run their functions at once: the node must free its pool thread.
    assert "DatasetToSingleElement" in seen["types"] and "PyFunc" not in seen["types"]
