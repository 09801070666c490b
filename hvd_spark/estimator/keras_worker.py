"""The KerasEstimator's worker side: ``model.fit`` on every rank, and the predictor.

No pyspark here: this runs in the ranks' processes. Batches come from the one
sharded reader (``train_spec.make_readers``); features are reshaped to the model's
input shapes and labels to ``label_shapes`` (default: the model's output shapes)
when a row holds as many values, as Horovod does.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import pickle
import tempfile
import time
from typing import Any

import cloudpickle
import numpy as np

from hvd_spark._env import LOCAL_RANK
from hvd_spark.estimator import history as hist
from hvd_spark.estimator import learning_rate as lr_rule
from hvd_spark.estimator.train_spec import (
    TrainSpec,
    check_loss,
    make_readers,
    set_start_method,
)

log = logging.getLogger("hvd_spark.estimator")


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


def row_shapes(tensors: Any) -> list[tuple[int, ...] | None]:
    """Per-row shapes of Keras input/output tensors (None where a dimension is unknown)."""
    out = []
    for t in tensors:
        dims = tuple(t.shape[1:])
        out.append(None if None in dims else tuple(int(d) for d in dims))
    return out


def shaped(array: np.ndarray, row_shape: tuple[int, ...] | None) -> np.ndarray:
    """``array`` (rows first) reshaped to ``row_shape`` when it holds as many values a row."""
    if row_shape is None or array.shape[1:] == row_shape:
        return array
    if math.prod(array.shape[1:]) == math.prod(row_shape):
        return array.reshape((len(array), *row_shape))
    return array


def model_array(values: Any) -> np.ndarray:
    """One column's values as the model takes them: floats as float32, integers kept.

    Integer (categorical) columns keep their dtype so that they reach Embedding layers
    as ids, not as rounded floats.
    """
    array = np.asarray(values)
    return array.astype(np.float32, copy=False) if array.dtype.kind == "f" else array


def model_arrays(arrays: list[Any], shapes: list) -> np.ndarray | tuple[np.ndarray, ...]:
    """Per-column arrays -> one array for one column, else a tuple (one per model input
    or output, in column order), each reshaped to its ``shapes`` entry when it fits.

    A tuple, not a list: Keras 3 builds ``model.fit``'s ``output_signature`` from a
    generator's first batch and rejects a list there (``TypeError: output_signature must
    contain objects that are subclass of tf.TypeSpec``); calling a model takes either.
    """
    # Columns beyond the model's known shapes still go through, so Keras names the mismatch.
    shapes = [*shapes, *[None] * (len(arrays) - len(shapes))]
    out = tuple(shaped(model_array(a), s) for a, s in zip(arrays, shapes))
    return out[0] if len(out) == 1 else out


def batch_xy(batch: dict, ds: Any, in_shapes: list, out_shapes: list) -> tuple:
    """A reader batch -> ``(x, y)`` or ``(x, y, sample_weight)`` for ``model.fit``.

    Args:
        batch: Column name -> numpy array, rows first.
        ds: The DatasetSpec (feature, label and sample-weight column names).
        in_shapes: Per-row shape of each model input (None: leave the column as it is).
        out_shapes: Per-row shape of each label (None: leave the column as it is).

    Returns:
        ``x`` and ``y`` are one array for one column, else a tuple of arrays in column
        order (one per model input or output).
    """
    x = model_arrays([batch[c] for c in ds.feature_cols], list(in_shapes))
    y = model_arrays([batch[c] for c in ds.label_cols], list(out_shapes))
    out: tuple = (x, y)
    if ds.sample_weight_col:
        out += (np.asarray(batch[ds.sample_weight_col], np.float32),)
    return out


def _forever(reader, start_epoch: int, to_xy):
    """Batches of every epoch in turn (Keras pulls steps_per_epoch of them per epoch)."""
    for epoch in itertools.count(start_epoch):
        for batch in reader.epoch(epoch):
            yield to_xy(batch)


def _optimizer_state(optimizer) -> bytes:
    return pickle.dumps([np.asarray(v) for v in optimizer.variables])


def place_keras(use_gpu: bool, local_rank: int, tf: Any) -> None:
    """Show TensorFlow one GPU, the rank's own, with ``use_gpu``, else none.

    Its own: the one Spark assigned it (``HVD_SPARK_GPU_INDEX``), else ``local_rank``
    wrapped around the GPUs (``devices.own_gpu_index``). Must run before TensorFlow
    initializes its devices. A CPU run hides the GPUs so it does not take the memory of
    GPUs that other work on the executor may hold. With ``use_gpu`` and no GPU visible,
    the rank trains on the CPU (Horovod's meaning); the driver is told (it warns).
    """
    from hvd_spark.estimator import devices

    gpus = tf.config.list_physical_devices("GPU")
    if use_gpu:
        devices.note_gpu_seen(bool(gpus))
    if not use_gpu or not gpus:
        if use_gpu and local_rank == 0:
            log.info("use_gpu=True but TensorFlow sees no GPU (CUDA_VISIBLE_DEVICES=%r): "
                     "training on the CPU", os.environ.get("CUDA_VISIBLE_DEVICES"))
        tf.config.set_visible_devices([], "GPU")
        return
    gpu = gpus[devices.own_gpu_index(local_rank, len(gpus))]
    tf.config.set_visible_devices([gpu], "GPU")
    tf.config.experimental.set_memory_growth(gpu, True)


def _user_callbacks(keras, payload: dict, rank: int, spec: TrainSpec, workdir: str) -> list:
    """The user's callbacks for this rank: TensorBoard on rank 0 only, writing to a local
    directory uploaded to the store's logs path after every epoch (without a Store, to
    its own ``log_dir`` on rank 0's host); the checkpoint
    callback on rank 0, writing to a local file."""
    out = []
    tensorboard = False
    for cb in cloudpickle.loads(payload["callbacks"]):
        if isinstance(cb, keras.callbacks.TensorBoard):
            if rank != 0:
                continue  # one writer per run, as in Horovod
            if spec.store is not None:  # else it writes to its own log_dir, on rank 0's host
                cb.log_dir = os.path.join(workdir, "logs")
                tensorboard = True
        out.append(cb)
    ckpt = cloudpickle.loads(payload["checkpoint_callback"])
    if ckpt is not None and rank == 0:
        suffix = ".weights.h5" if ckpt.save_weights_only else ".keras"
        ckpt.filepath = os.path.join(workdir, "checkpoint" + suffix)
        out.append(ckpt)
    if tensorboard:
        logs = spec.store.logs_path(spec.run_id)

        class UploadLogs(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs_=None):
                spec.store.upload_dir(os.path.join(workdir, "logs"), logs)

            def on_train_end(self, logs_=None):
                spec.store.upload_dir(os.path.join(workdir, "logs"), logs)

        out.append(UploadLogs())
    return out


def train_keras(spec: TrainSpec, payload: dict) -> dict | None:
    """Runs on every rank: model.fit with the distributed optimizer and callbacks."""
    set_start_method(spec.mp_start_method)
    import keras
    import tensorflow as tf

    import hvd_spark.tensorflow as hvd
    from hvd_spark.estimator.keras_rates import KerasRates

    place_keras(spec.use_gpu, int(os.environ.get(LOCAL_RANK, "0")), tf)
    hvd.init()
    if spec.framework_seed is not None:
        keras.utils.set_random_seed(spec.framework_seed)
    ds = spec.dataset
    custom = cloudpickle.loads(payload["custom_objects"])
    model = model_from_bytes(payload["model"], custom)
    in_shapes = row_shapes(model.inputs)
    out_shapes = ([tuple(s[1:]) for s in spec.label_shapes] if spec.label_shapes
                  else row_shapes(model.outputs))

    def to_xy(batch):
        return batch_xy(batch, ds, in_shapes, out_shapes)

    rates = KerasRates(payload["optimizer"],
                       hvd.size() if spec.extra.get(lr_rule.PARAM) else 1)
    optimizer = rates.optimizer
    history: list[dict] = []
    resume = spec.store.latest_checkpoint(spec.run_id) if spec.start_epoch > 0 else None
    if resume is not None:
        saved = pickle.loads(resume[1])
        model.set_weights(saved["weights"])
        history = saved["history"]
    dist_opt = hvd.DistributedOptimizer(
        optimizer, compression=spec.compression or hvd.Compression.none,
        backward_passes_per_step=spec.backward_passes_per_step,
        # The mean of the accumulated batches, as the Torch and Lightning Estimators step:
        # bpps x batch_size rows per rank behave as one batch of that size.
        average_aggregated_gradients=True)
    model.compile(optimizer=dist_opt, loss=cloudpickle.loads(payload["loss"]),
                  loss_weights=payload["loss_weights"],
                  metrics=cloudpickle.loads(payload["metrics"]))
    if resume is not None and saved["optimizer"]:
        dist_opt.build(model.trainable_variables)
        for var, value in zip(dist_opt.variables, pickle.loads(saved["optimizer"])):
            var.assign(value)
        rates.restore(dist_opt, saved.get("learning_rate"))
    reader, val_reader = make_readers(spec, hvd.rank(), hvd.size())
    fit_kwargs: dict[str, Any] = {}
    if val_reader is not None:
        fit_kwargs = {"validation_data": _forever(val_reader, 0, to_xy),
                      "validation_steps": val_reader.steps_per_epoch}

    class EpochEnd(keras.callbacks.Callback):
        """Rank 0 records, reports and checkpoints every epoch (after metric averaging)."""

        def on_epoch_end(self, epoch, logs=None):
            record = {"epoch": epoch + 1, **{k: float(v) for k, v in (logs or {}).items()}}
            history.append(record)
            if hvd.rank() == 0:
                hist.report(record, spec.epochs, spec.verbose)
            if hvd.rank() == 0 and spec.store is not None:  # direct path: no checkpoints
                state = {"weights": self.model.get_weights(), "history": history,
                         "optimizer": _optimizer_state(dist_opt),
                         "learning_rate": rates.user_rate(dist_opt)}
                spec.store.save_checkpoint(spec.run_id, epoch, pickle.dumps(state))

    class FiniteLoss(keras.callbacks.Callback):
        """Stops the fit with a DataError naming the epoch and step of a NaN/inf loss."""

        epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            # Keras logs the epoch's running mean: it turns non-finite at the first bad step.
            if logs and "loss" in logs:
                check_loss(float(logs["loss"]), self.epoch, batch, spec,
                           reader.steps_per_epoch, hvd.rank())

    class StepProgress(keras.callbacks.Callback):
        """Rank 0 sends step events for the driver's progress bar (fit's own is off)."""

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch_started = (epoch + 1, time.monotonic())

        def on_train_batch_end(self, batch, logs=None):
            epoch, started = self.epoch_started
            hist.step(spec.verbose, epoch, batch + 1, reader.steps_per_epoch,
                      float((logs or {}).get("loss", 0.0)),
                      (batch + 1) * spec.batch_size * hvd.size(), time.monotonic() - started)

    progress = [StepProgress()] if hvd.rank() == 0 else []
    with tempfile.TemporaryDirectory(prefix="hvd_spark_keras_") as workdir:
        user = _user_callbacks(keras, payload, hvd.rank(), spec, workdir)
        rates.adjust_callbacks(user, (hvd.callbacks.LearningRateScheduleCallback,
                                      hvd.callbacks.LearningRateWarmupCallback))
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), FiniteLoss(),
                     hvd.callbacks.MetricAverageCallback(), EpochEnd(), *progress, *user]
        if spec.start_epoch < spec.epochs:
            model.fit(_forever(reader, spec.start_epoch, to_xy), epochs=spec.epochs,
                      initial_epoch=spec.start_epoch, steps_per_epoch=reader.steps_per_epoch,
                      callbacks=callbacks, verbose=0, shuffle=False, **fit_kwargs)
        if hvd.rank() != 0:
            return None
        # The shipped model, uncompiled: clone_model would recompile a functional model from
        # its compile config, which fails on custom metrics or losses (functions by name).
        clean = model_from_bytes(payload["model"], custom)
        clean.set_weights(_final_weights(keras, model, workdir, custom))
    sample_x = to_xy(next(iter(reader.epoch(0))))[0]
    outs = clean(sample_x, training=False)
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    # cloudpickle: custom objects defined in the user's __main__ (a notebook) came here by
    # value and cannot be pickled by reference; pickle.loads still reads the result.
    data = cloudpickle.dumps({"model": model_to_bytes(clean), "custom_objects": custom})
    return {"model": data, "history": history,
            "optimizer": pickle.dumps(rates.unscaled_config(dist_opt)),
            "output_shapes": [tuple(np.asarray(o).shape[1:]) for o in outs]}


def _final_weights(keras, model, workdir: str, custom: dict) -> list:
    """The checkpoint callback's saved weights when it wrote any, else the last epoch's.

    Training is over: the weights file is loaded into ``model`` itself (a clone_model copy
    would recompile it, which fails on custom metrics and losses).
    """
    weights_file = os.path.join(workdir, "checkpoint.weights.h5")
    model_file = os.path.join(workdir, "checkpoint.keras")
    if os.path.exists(weights_file):
        model.load_weights(weights_file)
        return model.get_weights()
    if os.path.exists(model_file):
        return keras.models.load_model(model_file, custom_objects=custom,
                                       compile=False).get_weights()
    return model.get_weights()


def keras_predictor(model_bytes: bytes):
    """Model bytes -> ``predict(list of numpy inputs) -> list of numpy outputs``."""
    from hvd_spark.estimator.tf_quiet import import_keras_quietly

    import_keras_quietly()  # first: custom objects in the bytes may import Keras
    saved = pickle.loads(model_bytes)
    model = model_from_bytes(saved["model"], saved.get("custom_objects"))
    in_shapes = row_shapes(model.inputs)

    def predict(arrays: list[Any]) -> list:
        outs = model(model_arrays(list(arrays), in_shapes), training=False)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        return [np.asarray(o) for o in outs]

    return predict
