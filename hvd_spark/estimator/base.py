"""What every estimator shares: fit = check -> data to the ranks -> run the workers -> Model.

The data reach the ranks one of two ways: written to the Store first (``store_data``,
when ``store`` is set: checkpoints and resumption), or handed over by the ranks' own
Spark tasks (``direct_data``, without a Store).

A framework adapter (torch.py, keras.py) supplies what to ship (the serialized
model), the worker function that trains, and how a Model predicts. Frameworks are
imported only inside those functions, so the driver needs neither installed to
import this package.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

from pyspark.ml import Estimator, Model
from pyspark.ml.util import MLReadable, MLWritable

from hvd_spark.data.spec import DatasetSpec
from hvd_spark.data.store import Store
from hvd_spark.errors import ConfigError
from hvd_spark.estimator import devices, direct_data, recovery, tracking, transform, tuning
from hvd_spark.estimator.learning_rate import PARAM as LR_PARAM
from hvd_spark.estimator.params import SHARED_PARAMS, KeywordParams, define_params
from hvd_spark.estimator.persistence import PickledReader, PickledWriter
from hvd_spark.estimator.run_record import RunRecord
from hvd_spark.estimator.train_spec import TrainSpec, batch_shape
from hvd_spark.runner.backend import Backend, SparkBackend, as_backend
from hvd_spark.runner.console import verbose_logging

log = logging.getLogger(__name__)

_START_METHODS = ("fork", "spawn", "forkserver")

# Params a fitted model has (Horovod's names; outputCols is camelCase there too).
MODEL_PARAMS: list[tuple[str, str, Any, Any]] = [
    ("feature_columns", "feature column names, in the model's input order", None, None),
    ("label_columns", "label column names, one per model output", None, None),
    ("outputCols", "prediction column names (default: <label>__output)", None, None),
    ("run_id", "id of the run that trained the model", None, None),
    ("batch_size", "the training batch size (transform's too, by default)", None, 32),
    ("transform_batch_size", "rows per model call in transform (default: batch_size)", None, None),
    ("loss", "the loss used in training", None, None),
]


class PickledPersistence(MLWritable, MLReadable):
    """save/load through PickledWriter/PickledReader; subclasses add their blobs."""

    #: Params not saved (Horovod does not save them either): they hold live objects.
    _unsaved_params: tuple[str, ...] = ()

    def write(self) -> PickledWriter:
        instance = self
        unsaved = [p for p in self._unsaved_params if self.isSet(getattr(self, p))]
        if unsaved:
            instance = self.copy()
            for name in unsaved:
                instance.clear(getattr(instance, name))
        return PickledWriter(instance)

    @classmethod
    def read(cls) -> PickledReader:
        return PickledReader(cls)

    def _persisted_blobs(self) -> dict[str, bytes]:
        return {}

    def _blob_names(self) -> list[str]:
        return []

    def _restore_blobs(self, blobs: dict[str, bytes]) -> None:
        pass


class HvdEstimator(tracking.TrackedFit, Estimator, KeywordParams,
                   PickledPersistence):
    """Base of KerasEstimator and TorchEstimator (not used directly)."""

    _param_specs = SHARED_PARAMS
    _unsaved_params = ("backend",)
    #: Whether the worker honours checkpoint_every_steps (step checkpoints and resume).
    _step_checkpoints = False

    # ---------------------------------------------------------------- adapter hooks

    def _check_framework(self) -> None:
        """Raise ConfigError for framework objects that cannot work."""
        raise NotImplementedError

    def _check_dataset(self, dataset: DatasetSpec) -> None:
        """Raise ConfigError when the stored columns cannot feed the model (shapes)."""

    def _payload(self) -> Any:
        """The picklable serialized model/optimizer/loss shipped to the workers."""
        raise NotImplementedError

    def _worker(self) -> Callable[[TrainSpec, Any], dict]:
        """The function each rank runs: ``fn(spec, payload) -> {"model", "history", ...}``."""
        raise NotImplementedError

    def _model_class(self) -> type[HvdModel]:
        raise NotImplementedError

    def _model_params(self) -> dict[str, Any]:
        """Framework-specific Params of the fitted model."""
        return {}

    def _extra(self) -> dict:
        """Framework-specific TrainSpec settings."""
        return {}

    def _learning_rate_note(self, num_proc: int) -> str | None:
        """What the ranks' learning rate will be, said once at fit start (None: nothing)."""
        return None

    def _worker_env(self) -> dict[str, str]:
        """Environment variables for the ranks."""
        return {}

    # ---------------------------------------------------------------- checks

    def _check_params(self) -> None:
        required = ("model", "feature_cols", "label_cols")
        missing = [name for name in required if not self.value(name)]
        if missing:
            raise ConfigError(f"{type(self).__name__} needs {', '.join(missing)} to be set")
        for name in ("epochs", "batch_size", "partitions_per_process",
                     "backward_passes_per_step"):
            if self.value(name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {self.value(name)}")
        for name in ("num_proc", "val_batch_size", "train_steps_per_epoch",
                     "validation_steps_per_epoch", "train_reader_num_workers",
                     "val_reader_num_workers"):
            value = self.value(name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1 when set, got {value}")
        if self.value("max_retries") < 0:
            raise ConfigError(f"max_retries must be >= 0 (0: never retry), got "
                              f"{self.value('max_retries')}")
        every = self.value("checkpoint_every_steps")
        if every is not None and every < 1:
            raise ConfigError(f"checkpoint_every_steps must be >= 1 when set, got {every}")
        if every is not None and not self._step_checkpoints:
            raise ConfigError(f"checkpoint_every_steps is not supported by "
                              f"{type(self).__name__} yet (it checkpoints every epoch); "
                              "leave it unset, or use TorchEstimator")
        if (self.value("shuffle_buffer_size") or 0) < 0:
            raise ConfigError(f"shuffle_buffer_size must be >= 0, got "
                              f"{self.value('shuffle_buffer_size')}")
        validation = self.value("validation")
        if isinstance(validation, float) and not 0.0 <= validation < 1.0:
            raise ConfigError(f"validation as a fraction must be in [0, 1), got {validation}")
        method = self.value("mp_start_method")
        if method is not None and method not in _START_METHODS:
            raise ConfigError(f"mp_start_method must be one of {_START_METHODS}, got {method!r}")
        fn = self.value("transformation_fn")
        if fn is not None and not callable(fn):
            raise ConfigError(f"transformation_fn must be callable, got {type(fn).__name__}")
        if self.hasParam(LR_PARAM) and not isinstance(self.value(LR_PARAM), bool):
            raise ConfigError(f"{LR_PARAM} must be True (Horovod's rule: the rate x the number "
                              f"of ranks) or False (the rate as given), got "
                              f"{self.value(LR_PARAM)!r}")
        self._label_shapes()
        self._check_framework()

    def _label_shapes(self) -> list[tuple[int, ...]] | None:
        shapes = self.value("label_shapes")
        if shapes is None:
            return None
        labels = self.value("label_cols") or []
        if not isinstance(shapes, (list, tuple)) or len(shapes) != len(labels):
            raise ConfigError(f"label_shapes must hold one shape per label column "
                              f"({len(labels)}), got {shapes!r}")
        return [batch_shape(s, "label_shapes") for s in shapes]

    def _backend(self, record: RunRecord | None = None) -> Backend:
        """The user's backend, or a SparkBackend of ``num_proc`` ranks (Horovod's rule);
        a SparkBackend feeds ``record`` (bars, rank logs, TensorBoard)."""
        hooks = ({"progress": record.progress, "on_output": record.output}
                 if record is not None else {})
        backend, num_proc = self.value("backend"), self.value("num_proc")
        if backend is not None and num_proc is not None:
            raise ConfigError('at most one of the parameters "backend" and "num_proc" may be '
                              "given: set num_proc on the backend (SparkBackend(num_proc=...))")
        use_gpu = None if self.value("use_gpu") else False
        if backend is None:
            return SparkBackend(num_proc, verbose=self.value("verbose"), use_gpu=use_gpu,
                                **hooks)
        return as_backend(backend).with_options(use_gpu=use_gpu, **hooks)

    def _store(self) -> Store:
        store = self.value("store")
        if store is None:
            store = tempfile.mkdtemp(prefix="hvd_spark_store_")
            log.warning("no store given: using the local directory %s (set store=... to a "
                        "path every executor can reach on a real cluster)", store)
            self._set(store=store)
        return Store.create(store) if not isinstance(store, Store) else store

    # ---------------------------------------------------------------- fit

    def _fit(self, df):
        with verbose_logging(self.value("verbose")):
            return self._fit_df(df)

    def _fit_df(self, df):
        from hvd_spark.estimator import dry_run, store_data

        self._check_params()
        backend = self._backend()
        direct = self.value("store") is None  # the direct path: no Store, nothing written
        if direct:
            direct_data.check_backend(backend)
        store = None if direct else self._store()
        payload = self._checked_payload()
        _check_slots(backend)
        if store is not None:
            store_data.check_writable(store)
        dry_run.check(self, df)  # the model on a few rows, before any data moves
        if direct:
            dataset, rows = direct_data.prepare(self, df, backend.num_processes())
            direct_data.warn_once()
            return self._fit_on_dataset(dataset, None, payload, rows, df)
        dataset = store_data.prepare(self, df, store, backend.num_processes())
        return self._fit_on_dataset(dataset, store, payload, source=df)

    def _checked_payload(self) -> Any:
        """The payload, or a ConfigError naming the parameter that cannot be shipped."""
        import cloudpickle

        try:
            payload = self._payload()
            cloudpickle.dumps(payload)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - any pickling failure is the user's object
            culprit = "model"
            for name in _SHIPPED_PARAMS:
                if not self.hasParam(name):
                    continue
                try:
                    cloudpickle.dumps(self.value(name))
                except Exception:  # noqa: BLE001 - this one is the culprit
                    culprit = name
                    break
            raise ConfigError(
                f"{culprit} cannot be pickled to ship it to the workers "
                f"({type(exc).__name__}: {exc}); it must not hold open files, locks, sockets "
                "or a SparkSession (define such objects inside the model instead)") from exc
        return payload

    def fit_on_parquet(self, params: dict | None = None, dataset_idx: Any = None) -> HvdModel:
        """Train on data already written to the store, without a DataFrame (Horovod's API).

        Args:
            params: Optional param map overriding this estimator's params.
            dataset_idx: The index ``hvd_spark.data.dataset_index.prepare_data`` yielded
                (its files at ``store.get_train_data_path(dataset_idx)``), a
                ``DatasetSpec``, or None: the Parquet files at
                ``store.get_train_data_path()`` (and ``get_val_data_path()``), as in Horovod.
        """
        if params:
            return self.copy(params).fit_on_parquet(dataset_idx=dataset_idx)
        with verbose_logging(self.value("verbose")):
            return tracking.run_tracked(self, lambda: self._fit_stored(dataset_idx))

    def _fit_stored(self, dataset_idx: Any) -> HvdModel:
        self._check_params()
        store = self._store()
        from hvd_spark.estimator.store_data import stored_dataset

        dataset = stored_dataset(store, dataset_idx, self.value("feature_cols"),
                                  self.value("label_cols"), self.value("sample_weight_col"))
        wanted = [*self.value("feature_cols"), *self.value("label_cols")]
        if self.value("sample_weight_col"):
            wanted.append(self.value("sample_weight_col"))
        missing = [c for c in wanted if c not in dataset.column_names]
        if missing:
            raise ConfigError(f"fit_on_parquet: column(s) {missing} are not in the stored "
                              f"dataset, which holds {dataset.column_names}")
        # The estimator's columns decide which stored columns are features and labels.
        dataset = dataclasses.replace(
            dataset, feature_cols=tuple(self.value("feature_cols")),
            label_cols=tuple(self.value("label_cols")),
            sample_weight_col=self.value("sample_weight_col"))
        return self._fit_on_dataset(dataset, store)

    def _fit_on_dataset(self, dataset: DatasetSpec, store: Store | None, payload: Any = None,
                        rows: Any = None, source: Any = None) -> HvdModel:
        """Train on ``dataset``: the Store's shards, or with ``store`` None the DataFrame
        ``rows`` handed to the ranks (``direct_data``); ``source``: the user's DataFrame."""
        self._check_dataset(dataset)
        # A generated id is not stored on the estimator: fitting it again starts afresh.
        run_id = self.value("run_id") or f"run_{uuid.uuid4().hex[:12]}"
        start_epoch = self._resume_epoch(store, run_id) if store is not None else 0
        seed = self.value("random_seed")
        threads = (self.value("train_reader_num_workers"), self.value("val_reader_num_workers"))
        spec = TrainSpec(
            dataset=dataset, store=store, run_id=run_id,
            batch_size=self.value("batch_size"),
            val_batch_size=self.value("val_batch_size") or self.value("batch_size"),
            epochs=self.value("epochs"), start_epoch=start_epoch,
            shuffle=self.value("shuffle"), seed=0 if seed is None else seed,
            train_steps=self.value("train_steps_per_epoch"),
            val_steps=self.value("validation_steps_per_epoch"),
            backward_passes_per_step=self.value("backward_passes_per_step"),
            compression=self.value("gradient_compression"),
            verbose=self.value("verbose"), use_gpu=self.value("use_gpu"),
            framework_seed=seed,
            transformation_fn=self.value("transformation_fn"),
            inmemory_cache_all=self.value("inmemory_cache_all"),
            shuffle_buffer_size=self.value("shuffle_buffer_size"),
            train_reader_threads=threads[0], val_reader_threads=threads[1],
            label_shapes=self._label_shapes(),
            mp_start_method=self.value("mp_start_method"),
            extra=self._extra(),
            checkpoint_every_steps=self.value("checkpoint_every_steps"),
        )
        logs = store if store is not None else direct_data.logs_store()
        record = RunRecord(logs, run_id, spec.epochs, self.value("verbose"),
                           on_epoch=tracking.epoch_hook())  # MLflow, when tracked
        backend = self._backend(record)
        tracking.fit_started(run_id, logs, dataset, backend.num_processes(), source,
                             direct=store is None)
        note = self._learning_rate_note(backend.num_processes())
        if note:
            log.info("%s", note)
        if payload is None:
            payload = self._checked_payload()
        try:
            # A lost rank resumes from the last checkpoint on the same shards.
            # Each rank's result says whether it saw a GPU: the driver warns if none did.
            worker = functools.partial(devices.run_reporting, self._worker())
            reports = recovery.run_with_retries(backend, worker, spec, payload,
                                                self._worker_env(), self.value("max_retries"),
                                                rows)
        finally:
            record.close()
            tracking.fit_ran()
        results, seen = devices.unwrap(reports)
        devices.warn_if_no_gpu(type(self).__name__,
                               self.isSet(self.use_gpu) and self.value("use_gpu"), seen)
        return self._make_model(results[0], run_id)

    def _resume_epoch(self, store: Store, run_id: str) -> int:
        epochs = store.list_checkpoints(run_id)
        if not epochs:
            return 0
        log.info("run %s: resuming after the checkpoint of epoch %d", run_id, epochs[-1] + 1)
        return epochs[-1] + 1

    def _make_model(self, result: dict, run_id: str) -> HvdModel:
        model = self._model_class()()
        tuning.carry(self, model)  # the Estimator's params, as Spark ML models have them
        labels = self.value("label_cols")
        params = {
            "feature_columns": self.value("feature_cols"), "label_columns": labels,
            "outputCols": self.value("output_cols") or [f"{c}__output" for c in labels],
            "run_id": run_id, "batch_size": self.value("batch_size"),
            "loss": self.value("loss"),
            **self._model_params(),
        }
        model._set(**{k: v for k, v in params.items() if v is not None})
        model._set_trained(result["model"], result["history"], result.get("output_shapes", []),
                           run_id)
        model._set_extra(result)
        return model

    def _init_empty(self) -> None:
        KeywordParams.__init__(self)


class HvdModel(Model, KeywordParams, PickledPersistence):
    """A trained model; ``transform`` adds prediction columns with batched inference."""

    _param_specs = MODEL_PARAMS

    def __init__(self) -> None:
        super().__init__()
        self.model_bytes = b""
        self.records: list[dict] = []
        self.output_shapes: list[tuple[int, ...]] = []

    def _set_trained(self, model_bytes: bytes, history: list[dict],
                     output_shapes: list, run_id: str) -> None:
        self.model_bytes = model_bytes
        self.records = [dict(h) for h in history]
        self.output_shapes = [tuple(s) for s in output_shapes]
        self._set(run_id=run_id)

    def _set_extra(self, result: dict) -> None:
        """Framework-specific results of training (e.g. the optimizer's state)."""

    def getHistory(self) -> Any:  # noqa: N802 - Spark ML naming
        """Per-epoch metrics, in Horovod's shape for the framework."""
        raise NotImplementedError

    def output_columns(self) -> list[str]:
        """Prediction column names: ``outputCols`` or ``<label>__output``."""
        return (self.value("outputCols")
                or [f"{c}__output" for c in self.value("label_columns") or []])

    def predictor_factory(self) -> Callable[[bytes], Callable]:
        """Module-level function: model bytes -> ``predict(list of arrays) -> list of arrays``."""
        raise NotImplementedError

    def _transform(self, df):
        return transform.predict_columns(
            df, self.value("feature_columns"), self.output_columns(), self.output_shapes,
            self.model_bytes, self.predictor_factory(), tuning.rows_per_call(self))

    def _init_empty(self) -> None:
        HvdModel.__init__(self)

    def _persisted_blobs(self) -> dict[str, bytes]:
        import json

        meta = {"history": self.records, "output_shapes": self.output_shapes,
                "run_id": self.getRunId()}
        return {"model.bin": self.model_bytes, "trained.json": json.dumps(meta).encode()}

    def _blob_names(self) -> list[str]:
        return ["model.bin", "trained.json"]

    def _restore_blobs(self, blobs: dict[str, bytes]) -> None:
        import json

        meta = json.loads(blobs["trained.json"])
        self._set_trained(blobs["model.bin"], meta["history"], meta["output_shapes"],
                          meta["run_id"])


_SHIPPED_PARAMS = ("model", "optimizer", "loss", "loss_constructors", "metrics", "callbacks",
                   "custom_objects", "train_minibatch_fn", "transformation_fn",
                   "checkpoint_callback")


def _check_slots(backend: Backend) -> None:
    """Refuse num_proc above the cluster's task slots before any data is written."""
    backend.check()


def define(cls: type, extra_specs: list, base: list | None = None) -> type:
    """Give a class its Params (shared + framework extras) and accessors."""
    cls._param_specs = (SHARED_PARAMS if base is None else base) + extra_specs
    return define_params(cls, cls._param_specs)


define_params(HvdEstimator, SHARED_PARAMS)
define_params(HvdModel, MODEL_PARAMS)
