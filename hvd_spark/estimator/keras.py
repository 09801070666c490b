"""KerasEstimator / KerasModel: fit a Keras 3 model on a DataFrame with hvd_spark.

TensorFlow and Keras are imported only inside the worker and predictor functions,
so the driver can build the estimator (and this module imports) without them.
"""

from __future__ import annotations

import itertools
import os
import pickle
import tempfile
from typing import Any

import cloudpickle
import numpy as np

from hvd_spark._env import LOCAL_RANK
from hvd_spark.errors import ConfigError
from hvd_spark.estimator import history as hist
from hvd_spark.estimator.base import HvdEstimator, HvdModel, define
from hvd_spark.estimator.train_spec import TrainSpec, make_readers

KERAS_PARAMS = [
    ("customObjects", "custom_objects needed to load the model", None, None),
]


def model_to_bytes(model: Any) -> bytes:
    """A Keras model as the bytes of a ``.keras`` file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def model_from_bytes(data: bytes, custom_objects: dict | None = None) -> Any:
    """Inverse of ``model_to_bytes`` (uncompiled)."""
    import keras

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.models.load_model(path, custom_objects=custom_objects, compile=False)


class KerasModel(HvdModel):
    """A KerasEstimator's trained model; ``transform`` adds ``<label>__output`` columns."""

    def _predictor_factory(self):
        return keras_predictor

    def getModel(self):  # noqa: N802 - Spark ML naming
        """The trained Keras model (uncompiled)."""
        return model_from_bytes(pickle.loads(self.model_bytes)["model"])


class KerasEstimator(HvdEstimator):
    """Spark ML Estimator training a Keras 3 model with hvd_spark's DistributedOptimizer.

    Keywords are Horovod's: ``num_proc, model, optimizer, loss, metrics, feature_cols,
    label_cols, batch_size, val_batch_size, epochs, validation, callbacks, store, run_id,
    shuffle, random_seed, verbose, sample_weight_col, train_steps_per_epoch,
    validation_steps_per_epoch, partitions_per_process, gradient_compression,
    backward_passes_per_step, use_gpu, custom_objects`` and ``output_cols``.

    The learning rate is used as given (not scaled by the number of ranks). Every rank
    starts from rank 0's weights (BroadcastGlobalVariablesCallback) and epoch metrics
    are averaged over ranks (MetricAverageCallback).
    """

    def _model_class(self):
        return KerasModel

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

    def _payload(self) -> dict:
        import keras

        return {
            "model": model_to_bytes(self.value("model")),
            "optimizer": keras.optimizers.serialize(self.value("optimizer")),
            "loss": cloudpickle.dumps(self.value("loss")),
            "metrics": cloudpickle.dumps(self.value("metrics") or []),
            "callbacks": cloudpickle.dumps(self.value("callbacks") or []),
            "custom_objects": cloudpickle.dumps(self.value("customObjects") or {}),
        }

    def _worker(self):
        return train_keras

    def _worker_env(self) -> dict[str, str]:
        # TensorFlow's C++ start-up chatter would otherwise fill every rank's output.
        return {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}


define(KerasEstimator, KERAS_PARAMS)


def _xy(batch: dict, ds) -> tuple:
    def pick(cols):
        arrays = [np.asarray(batch[c], np.float32) if batch[c].dtype.kind == "f"
                  else np.asarray(batch[c]) for c in cols]
        return arrays[0] if len(arrays) == 1 else arrays

    out = (pick(ds.feature_cols), pick(ds.label_cols))
    if ds.sample_weight_col:
        out += (np.asarray(batch[ds.sample_weight_col], np.float32),)
    return out


def _forever(reader, ds, start_epoch: int):
    """Batches of every epoch in turn (Keras pulls steps_per_epoch of them per epoch)."""
    for epoch in itertools.count(start_epoch):
        for batch in reader.epoch(epoch):
            yield _xy(batch, ds)


def _optimizer_state(optimizer) -> bytes:
    return pickle.dumps([np.asarray(v) for v in optimizer.variables])


def place_keras(use_gpu: bool, local_rank: int, tf: Any) -> None:
    """Show TensorFlow one GPU (``local_rank % count``) with ``use_gpu``, else none.

    Must run before TensorFlow initializes its devices. A CPU run hides the GPUs so it
    does not take the memory of GPUs that other work on the executor may hold.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if not use_gpu:
        tf.config.set_visible_devices([], "GPU")
        return
    if not gpus:
        raise ConfigError(
            "use_gpu=True, but TensorFlow sees no GPU on this rank (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}; tensorflow-cpu has no GPU support). "
            "Install a GPU build of TensorFlow on the executors, or pass use_gpu=False"
        )
    gpu = gpus[local_rank % len(gpus)]
    tf.config.set_visible_devices([gpu], "GPU")
    tf.config.experimental.set_memory_growth(gpu, True)


def train_keras(spec: TrainSpec, payload: dict) -> dict | None:
    """Runs on every rank: model.fit with the distributed optimizer and callbacks."""
    import keras
    import tensorflow as tf

    import hvd_spark.tensorflow as hvd

    place_keras(spec.use_gpu, int(os.environ.get(LOCAL_RANK, "0")), tf)
    hvd.init()
    keras.utils.set_random_seed(spec.seed)
    ds = spec.dataset
    custom = cloudpickle.loads(payload["custom_objects"])
    model = model_from_bytes(payload["model"], custom)
    optimizer = keras.optimizers.deserialize(payload["optimizer"])
    history: list[dict] = []
    resume = spec.store.latest_checkpoint(spec.run_id) if spec.start_epoch > 0 else None
    if resume is not None:
        saved = pickle.loads(resume[1])
        model.set_weights(saved["weights"])
        history = saved["history"]
    dist_opt = hvd.DistributedOptimizer(
        optimizer, compression=spec.compression or hvd.Compression.none,
        backward_passes_per_step=spec.backward_passes_per_step)
    model.compile(optimizer=dist_opt, loss=cloudpickle.loads(payload["loss"]),
                  metrics=cloudpickle.loads(payload["metrics"]))
    if resume is not None and saved["optimizer"]:
        dist_opt.build(model.trainable_variables)
        for var, value in zip(dist_opt.variables, pickle.loads(saved["optimizer"])):
            var.assign(value)
    reader, val_reader = make_readers(spec, hvd.rank(), hvd.size())
    fit_kwargs: dict[str, Any] = {}
    if val_reader is not None:
        fit_kwargs = {"validation_data": _forever(val_reader, ds, 0),
                      "validation_steps": val_reader.steps_per_epoch}

    class EpochEnd(keras.callbacks.Callback):
        """Rank 0 records, reports and checkpoints every epoch (after metric averaging)."""

        def on_epoch_end(self, epoch, logs=None):
            record = {"epoch": epoch + 1, **{k: float(v) for k, v in (logs or {}).items()}}
            history.append(record)
            if hvd.rank() == 0:
                hist.report(record, spec.epochs, spec.verbose)
                state = {"weights": self.model.get_weights(), "history": history,
                         "optimizer": _optimizer_state(dist_opt)}
                spec.store.save_checkpoint(spec.run_id, epoch, pickle.dumps(state))

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(),
                 *cloudpickle.loads(payload["callbacks"]), EpochEnd()]
    if spec.start_epoch < spec.epochs:
        model.fit(_forever(reader, ds, spec.start_epoch), epochs=spec.epochs,
                  initial_epoch=spec.start_epoch, steps_per_epoch=reader.steps_per_epoch,
                  callbacks=callbacks, verbose=0, shuffle=False, **fit_kwargs)
    if hvd.rank() != 0:
        return None
    clean = keras.models.clone_model(model)  # without the distributed optimizer attached
    clean.set_weights(model.get_weights())
    sample_x = _xy(next(iter(reader.epoch(0))), ds)[0]
    outs = clean(sample_x, training=False)
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    data = pickle.dumps({"model": model_to_bytes(clean), "custom_objects": custom})
    return {"model": data, "history": history,
            "output_shapes": [tuple(np.asarray(o).shape[1:]) for o in outs]}


def keras_predictor(model_bytes: bytes):
    """Model bytes -> ``predict(list of numpy inputs) -> list of numpy outputs``."""
    saved = pickle.loads(model_bytes)
    model = model_from_bytes(saved["model"], saved.get("custom_objects"))

    def predict(arrays: list[Any]) -> list:
        inputs = [np.asarray(a, np.float32) if np.asarray(a).dtype.kind == "f" else a
                  for a in arrays]
        outs = model(inputs[0] if len(inputs) == 1 else inputs, training=False)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        return [np.asarray(o) for o in outs]

    return predict


__all__ = ["KerasEstimator", "KerasModel"]
