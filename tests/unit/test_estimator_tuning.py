"""Tuning's pure parts: the learning_rate Param on copies of the optimizer, the Params a
model carries from its Estimator, transform's batch size, and which saved Params are JSON
(no Spark job)."""

from __future__ import annotations

import cloudpickle
import keras
import pytest
import torch
from pyspark.ml.param import Param

from hvd_spark.errors import ConfigError
from hvd_spark.estimator import (
    KerasEstimator,
    KerasModel,
    LightningModel,
    TorchEstimator,
    TorchModel,
)
from hvd_spark.estimator.learning_rate import check_rate, keras_at_rate, torch_at_rate
from hvd_spark.estimator.persistence import json_params
from hvd_spark.estimator.tuning import NOT_CARRIED, carry, rows_per_call


def _torch(**overrides) -> TorchEstimator:
    model = torch.nn.Linear(3, 1)
    kwargs = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                  loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"])
    return TorchEstimator(**{**kwargs, **overrides})


def test_torch_rate_applies_to_a_copy_of_every_group_and_keeps_the_parameters():
    model = torch.nn.Linear(3, 1)
    user = torch.optim.Adam([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.5}],
                            lr=0.01)
    torch.optim.lr_scheduler.StepLR(user, 1)  # sets initial_lr on every group
    copy = torch_at_rate(user, 0.2)
    assert [g["lr"] for g in copy.param_groups] == [0.2, 0.2]
    assert [g["initial_lr"] for g in copy.param_groups] == [0.2, 0.2]
    assert copy.defaults["lr"] == 0.2 and isinstance(copy, torch.optim.Adam)
    # The user's optimizer is as it was.
    assert [g["lr"] for g in user.param_groups] == [0.01, 0.5] and user.defaults["lr"] == 0.01
    # Pickled with the model (as the payload is), the copy is still over its parameters.
    model2, copy2 = cloudpickle.loads(cloudpickle.dumps((model, copy)))
    assert copy2.param_groups[1]["params"][0] is model2.bias
    assert torch_at_rate(user, None) is user


def test_keras_rate_replaces_the_rate_or_schedule_in_a_copy_of_the_config():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    config = keras.optimizers.serialize(keras.optimizers.Adam(learning_rate=schedule))
    out = keras_at_rate(config, 0.03)
    assert out["config"]["learning_rate"] == 0.03
    assert isinstance(config["config"]["learning_rate"], dict)  # the schedule, unchanged
    assert keras.optimizers.deserialize(out).learning_rate.numpy() == pytest.approx(0.03)
    assert keras_at_rate(config, None) is config


@pytest.mark.parametrize("bad", [0, -0.1, float("nan"), float("inf"), "0.1", True])
def test_a_rate_must_be_a_positive_finite_number(bad):
    with pytest.raises(ConfigError, match="learning_rate must be a finite number > 0"):
        check_rate(bad)
    check_rate(None)
    check_rate(3)


def test_the_drivers_note_and_the_payload_use_the_overridden_rate():
    est = _torch(learning_rate=0.2)
    assert "learning rate 0.2 x 2 rank(s) = 0.4" in est._learning_rate_note(2)
    model, optimizer = cloudpickle.loads(est._payload()["model_and_optimizer"])
    assert [g["lr"] for g in optimizer.param_groups] == [0.2]
    assert optimizer.param_groups[0]["params"][0] is model.weight
    assert est.getOptimizer().param_groups[0]["lr"] == 0.01
    assert "learning rate 0.01 x 2" in _torch()._learning_rate_note(2)  # default: its own

    inputs = keras.Input((3,))
    user = keras.optimizers.SGD(learning_rate=0.01)
    keras_est = KerasEstimator(model=keras.Model(inputs, keras.layers.Dense(1)(inputs)),
                               optimizer=user, loss="mse", feature_cols=["x"],
                               label_cols=["y"], learning_rate=0.3)
    assert "learning rate 0.3 x 2 rank(s) = 0.6" in keras_est._learning_rate_note(2)
    assert keras_est._payload()["optimizer"]["config"]["learning_rate"] == 0.3
    assert float(user.learning_rate.numpy()) == pytest.approx(0.01)


def test_a_bad_rate_is_refused_before_any_data_is_written():
    with pytest.raises(ConfigError, match="learning_rate must be"):
        _torch(learning_rate=-1.0)._check_params()


def test_learning_rate_is_a_grid_param_with_accessors():
    est = _torch()
    assert est.getLearningRate() is None
    assert est.copy({est.learning_rate: 0.05}).getLearningRate() == 0.05
    assert est.setLearningRate(0.1).getLearningRate() == 0.1


@pytest.mark.parametrize("cls", [TorchModel, KerasModel, LightningModel])
def test_models_carry_the_training_params_but_not_live_objects(cls):
    for getter in ("getEpochs", "getBatchSize", "getValBatchSize", "getRandomSeed",
                   "getMetrics", "getCallbacks", "getValidation", "getNumProc"):
        assert callable(getattr(cls, getter)), getter
    assert not set(NOT_CARRIED) & set(cls._carried_params)
    assert not isinstance(getattr(cls, "store", None), Param)
    assert not isinstance(getattr(cls, "optimizer", None), Param)
    # The trained model and optimizer keep their getters (not the Estimator's objects).
    assert cls.getModel.__qualname__.startswith(cls.__name__)
    assert ("learning_rate" in cls._carried_params) == (cls is not LightningModel)


def test_carry_copies_what_the_estimator_set():
    est = _torch(epochs=3, batch_size=20, learning_rate=0.05, random_seed=7)
    model = TorchModel()
    carry(est, model)
    assert (model.getEpochs(), model.getLearningRate(), model.getRandomSeed()) == (3, 0.05, 7)
    assert model.getShuffle() is True  # a default, the same on both


def test_transform_batches_by_the_training_batch_size_unless_told_otherwise():
    model = TorchModel()
    model._set(batch_size=20)
    assert rows_per_call(model) == 20 and model.getBatchSize() == 20
    model.setTransformBatchSize(500)
    assert rows_per_call(model) == 500 and model.getBatchSize() == 20


def test_values_json_would_change_are_pickled_not_written_as_json():
    est = _torch(label_shapes=[(1,)], validation=0.2, epochs=2)
    saved = json_params(est)
    assert saved["validation"] == 0.2 and saved["epochs"] == 2
    assert "label_shapes" not in saved  # a list of tuples: JSON would give lists back
    assert "optimizer" not in saved and "model" not in saved


def test_param_map_objects_are_pickled_once_and_rebind_the_loaded_estimator(tmp_path):
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    from hvd_spark.estimator import param_map_io, persistence

    est = _torch()
    adam = torch.optim.Adam(est.getModel().parameters(), lr=0.01)
    grid = (ParamGridBuilder().baseOn({est.optimizer: adam})
            .addGrid(est.learning_rate, [0.1, 0.2]).build())
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid)  # no evaluator: no JVM
    proxy = param_map_io._wrap(str(tmp_path), cv)
    written = proxy.getEstimatorParamMaps()
    assert all(isinstance(m[est.optimizer], param_map_io.PickledParamValue) for m in written)
    assert [m[est.learning_rate] for m in written] == [0.1, 0.2]  # JSON: Spark writes them
    assert cv.getEstimatorParamMaps()[0][est.optimizer] is adam  # the validator unchanged
    # As Spark loads it: the estimator first (its own copy), then the maps' values.
    loaded = cloudpickle.loads(cloudpickle.dumps(est))
    persistence.LOADED[loaded.uid] = loaded
    saved = param_map_io._saved(str(tmp_path), [est.uid])
    first, second = saved["values"]
    assert first is second and isinstance(first, torch.optim.Adam)
    own = {id(p) for p in loaded.getModel().parameters()}
    assert all(id(p) in own for g in first.param_groups for p in g["params"])
    assert param_map_io._saved(str(tmp_path), [est.uid]) is saved  # once per load
