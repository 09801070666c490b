"""KerasEstimator / KerasModel: fit a Keras 3 model on a DataFrame with hvd_spark.

TensorFlow and Keras are imported only inside the worker and predictor functions,
so the driver can build the estimator (and this module imports) without them.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
from typing import Any

import cloudpickle

from hvd_spark.errors import ConfigError
from hvd_spark.estimator import dry_run, learning_rate
from hvd_spark.estimator.base import MODEL_PARAMS, HvdEstimator, HvdModel, define
from hvd_spark.estimator.keras_worker import (  # noqa: F401 - place_keras re-exported
    keras_predictor,
    model_from_bytes,
    model_to_bytes,
    place_keras,
    train_keras,
)
from hvd_spark.estimator.params import keyword_only_params
from hvd_spark.estimator.tuning import carried_params

log = logging.getLogger("hvd_spark.estimator")

KERAS_PARAMS = [
    ("custom_objects", "custom_objects needed to load the model", None, None),
    ("checkpoint_callback", "a keras ModelCheckpoint deciding which epoch's weights the "
     "fitted model gets (e.g. save_best_only=True)", None, None),
    ("backend_env", "environment variables added to every rank's", None, None),
    learning_rate.PARAM_SPEC,
    learning_rate.RATE_SPEC,
    dry_run.PARAM_SPEC,
]

KERAS_MODEL_PARAMS = [
    ("custom_objects", "custom_objects needed to load the model", None, None),
]


class KerasModel(HvdModel):
    """A KerasEstimator's trained model; ``transform`` adds ``<label>__output`` columns."""

    def __init__(self) -> None:
        super().__init__()
        self.optimizer_config: Any = None
        self._keras_model: Any = None

    def predictor_factory(self):
        return keras_predictor

    def _set_extra(self, result: dict) -> None:
        self.optimizer_config = result.get("optimizer")

    def getModel(self):  # noqa: N802 - Spark ML naming
        """The trained Keras model (uncompiled); the same object every call."""
        if self._keras_model is None:
            saved = pickle.loads(self.model_bytes)
            self._keras_model = model_from_bytes(saved["model"], saved.get("custom_objects"))
        return self._keras_model

    def getOptimizer(self):  # noqa: N802 - Spark ML naming
        """A new optimizer with the trained one's configuration (not its slot variables)."""
        import keras

        if self.optimizer_config is None:
            return None
        return keras.optimizers.deserialize(pickle.loads(self.optimizer_config))

    def getHistory(self) -> dict[str, list]:  # noqa: N802 - Spark ML naming
        """Horovod's Keras history (Keras' ``History.history``): metric -> one value per
        epoch, e.g. ``history["val_loss"][-1]``."""
        keys = [k for r in self.records for k in r if k != "epoch"]
        return {k: [r.get(k) for r in self.records] for k in dict.fromkeys(keys)}

    def _persisted_blobs(self) -> dict[str, bytes]:
        return {**super()._persisted_blobs(), "optimizer.bin": self.optimizer_config or b""}

    def _blob_names(self) -> list[str]:
        return [*super()._blob_names(), "optimizer.bin"]

    def _restore_blobs(self, blobs: dict[str, bytes]) -> None:
        super()._restore_blobs(blobs)
        self.optimizer_config = blobs["optimizer.bin"] or None

    def _init_empty(self) -> None:
        KerasModel.__init__(self)


class KerasEstimator(HvdEstimator):
    """Spark ML Estimator training a Keras 3 model with hvd_spark's DistributedOptimizer.

    Parameters are Horovod's ``horovod.spark.keras.KerasEstimator``'s, with its meaning,
    plus ``output_cols`` (see the guide ``docs/guides/porting.md``, "Spark"):

    - Feature columns are reshaped to the model's input shapes and labels to
      ``label_shapes`` (default: the model's output shapes) when they hold as many
      values per row: a flat 784-value Vector feeds a ``(28, 28, 1)`` input, and
      one-hot (Sparse)Vector labels feed a softmax output.
    - As in Horovod, each rank trains with the optimizer's learning rate times the number
      of ranks (a schedule's rates too), and Horovod's ``LearningRateScheduleCallback`` /
      ``LearningRateWarmupCallback`` get the scaled rate as ``initial_lr``; checkpoints,
      ``getOptimizer()`` and a resumed fit carry the rate as given.
      ``scale_learning_rate=False`` (hvd_spark only) keeps the rate as given.
      ``learning_rate`` (hvd_spark only) replaces the optimizer's rate or schedule in the
      serialized optimizer the ranks build (the user's is not changed), before that rule.
    - Every rank starts from rank 0's weights (BroadcastGlobalVariablesCallback) and
      epoch metrics are averaged over ranks (MetricAverageCallback).
    - A TensorBoard callback runs on rank 0 only; its logs go to the store's logs path
      of the run (``store.get_logs_path(run_id)``), as in Horovod.
    - ``use_gpu`` (default True) trains on a GPU when the rank has one, else on the CPU.
    """

    @keyword_only_params
    def __init__(self, num_proc=None, data_module=None, model=None, backend=None, store=None,
                 custom_objects=None, optimizer=None, loss=None, loss_weights=None,
                 sample_weight_col=None, gradient_compression=None, metrics=None,
                 feature_cols=None, label_cols=None, continuous_cols=None,
                 categorical_cols=None, validation=None, callbacks=None, batch_size=None,
                 val_batch_size=None, epochs=None, verbose=None, random_seed=None,
                 shuffle_buffer_size=None, shuffle=True, partitions_per_process=None,
                 run_id=None, train_steps_per_epoch=None, validation_steps_per_epoch=None,
                 transformation_fn=None, train_reader_num_workers=None,
                 val_reader_num_workers=None, reader_pool_type="thread", label_shapes=None,
                 checkpoint_callback=None, inmemory_cache_all=False, backend_env=None,
                 use_gpu=True, mp_start_method=None, tensorflow_dataset_prefetch_buffer_size=0,
                 backward_passes_per_step=1, compress_sparse_cols=False,
                 transformation_edit_fields=None, transformation_removed_fields=None,
                 output_cols=None,
                 max_retries=3, checkpoint_every_steps=None, scale_learning_rate=True,
                 learning_rate=None, mlflow=None, dry_run=True):
        super().__init__()
        self.setParams(**self._input_kwargs)

    def _model_class(self):
        return KerasModel

    def _extra(self) -> dict:
        return {learning_rate.PARAM: self.value(learning_rate.PARAM)}

    def _learning_rate_note(self, num_proc: int) -> str:
        rate = learning_rate.keras_rate(self._optimizer_config())
        return learning_rate.describe(None if rate is None else [rate], num_proc,
                                      self.value(learning_rate.PARAM), type(self).__name__)

    def _optimizer_config(self) -> dict:
        """The serialized optimizer the ranks build, at ``learning_rate`` when it is set."""
        import keras

        return learning_rate.keras_at_rate(keras.optimizers.serialize(self.value("optimizer")),
                                           self.value(learning_rate.RATE))

    def _check_framework(self) -> None:
        import keras

        if not isinstance(self.value("model"), keras.Model):
            raise ConfigError(
                f"model must be a keras.Model, got {type(self.value('model')).__name__}")
        if not isinstance(self.value("optimizer"), keras.optimizers.Optimizer):
            raise ConfigError("optimizer must be a keras.optimizers.Optimizer, got "
                              f"{type(self.value('optimizer')).__name__}")
        if self.value("loss") is None:
            raise ConfigError("KerasEstimator needs loss=... (a name or a keras loss)")
        ckpt = self.value("checkpoint_callback")
        if ckpt is not None and not isinstance(ckpt, keras.callbacks.ModelCheckpoint):
            raise ConfigError(f"checkpoint_callback must be a keras.callbacks.ModelCheckpoint, "
                              f"got {type(ckpt).__name__}")
        env = self.value("backend_env")
        if env is not None and not (isinstance(env, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise ConfigError(f"backend_env must be a dict of str to str, got {env!r}")
        learning_rate.check_rate(self.value(learning_rate.RATE))

    def _check_dataset(self, dataset) -> None:
        model = self.value("model")
        for col, tensor in zip(self.value("feature_cols"), model.inputs):
            dims = tuple(tensor.shape[1:])
            size = math.prod(dataset.column(col).shape)
            if None not in dims and math.prod(dims) != size:
                raise ConfigError(
                    f"feature column {col!r} holds {size} values per row but the model input "
                    f"{tensor.name!r} has shape {dims} ({math.prod(dims)} values)")

    def _model_params(self) -> dict:
        return {"custom_objects": self.value("custom_objects")}

    def _payload(self) -> dict:
        return {
            "model": model_to_bytes(self.value("model")),
            "optimizer": self._optimizer_config(),
            "loss": cloudpickle.dumps(self.value("loss")),
            "metrics": cloudpickle.dumps(self.value("metrics") or []),
            "callbacks": cloudpickle.dumps(self.value("callbacks") or []),
            "custom_objects": cloudpickle.dumps(self.value("custom_objects") or {}),
            "loss_weights": self.value("loss_weights"),
            "checkpoint_callback": cloudpickle.dumps(self.value("checkpoint_callback")),
        }

    def _dry_run(self, sample, batch) -> None:
        from hvd_spark.estimator.dry_run_keras import keras_check

        keras_check(self, sample, batch, self._label_shapes())

    def _worker(self):
        return train_keras

    def _worker_env(self) -> dict[str, str]:
        # TensorFlow's C++ start-up chatter would otherwise fill every rank's output.
        return {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
                **(self.value("backend_env") or {})}


define(KerasEstimator, KERAS_PARAMS)
define(KerasModel, carried_params(KerasModel, KERAS_MODEL_PARAMS, KerasEstimator),
       base=MODEL_PARAMS)

__all__ = ["KerasEstimator", "KerasModel"]
