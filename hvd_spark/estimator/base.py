"""What both estimators share: fit = check -> write data -> run the workers -> Model.

A framework adapter (torch.py, keras.py) supplies what to ship (the serialized
model), the worker function that trains, and how a Model predicts. Frameworks are
imported only inside those functions, so the driver needs neither installed to
import this package.
"""

from __future__ import annotations

import logging
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

from pyspark.ml import Estimator, Model
from pyspark.ml.util import MLReadable, MLWritable

from hvd_spark.data.store import Store
from hvd_spark.errors import ConfigError
from hvd_spark.estimator import progress, transform
from hvd_spark.estimator.params import MODEL_PARAMS, SHARED_PARAMS, KeywordParams, define_params
from hvd_spark.estimator.persistence import PickledReader, PickledWriter
from hvd_spark.estimator.train_spec import TrainSpec

log = logging.getLogger(__name__)


class PickledPersistence(MLWritable, MLReadable):
    """save/load through PickledWriter/PickledReader; subclasses add their blobs."""

    def write(self) -> PickledWriter:
        return PickledWriter(self)

    @classmethod
    def read(cls) -> PickledReader:
        return PickledReader(cls)

    def _persisted_blobs(self) -> dict[str, bytes]:
        return {}

    def _blob_names(self) -> list[str]:
        return []

    def _restore_blobs(self, blobs: dict[str, bytes]) -> None:
        pass


class HvdEstimator(Estimator, KeywordParams, PickledPersistence):
    """Base of KerasEstimator and TorchEstimator (not used directly)."""

    _param_specs = SHARED_PARAMS

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.set_keywords(kwargs)

    # ---------------------------------------------------------------- adapter hooks

    def _check_framework(self) -> None:
        """Raise ConfigError for framework objects that cannot work."""
        raise NotImplementedError

    def _payload(self) -> Any:
        """The picklable serialized model/optimizer/loss shipped to the workers."""
        raise NotImplementedError

    def _worker(self) -> Callable[[TrainSpec, Any], dict]:
        """The function each rank runs: ``fn(spec, payload) -> {"model", "history", ...}``."""
        raise NotImplementedError

    def _model_class(self) -> type[HvdModel]:
        raise NotImplementedError

    def _extra(self) -> dict:
        """Framework-specific TrainSpec settings."""
        return {}

    def _worker_env(self) -> dict[str, str]:
        """Environment variables for the ranks."""
        return {}

    # ---------------------------------------------------------------- fit

    def _check_params(self) -> None:
        required = ("model", "featureCols", "labelCols")
        missing = [snake for snake in required if not self.value(snake)]
        if missing:
            raise ConfigError(f"{type(self).__name__} needs {', '.join(missing)} to be set")
        for name in ("epochs", "batchSize", "partitionsPerProcess", "backwardPassesPerStep"):
            if self.value(name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {self.value(name)}")
        for name in ("numProc", "valBatchSize", "trainStepsPerEpoch", "validationStepsPerEpoch"):
            value = self.value(name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1 when set, got {value}")
        validation = self.value("validation")
        if isinstance(validation, float) and not 0.0 <= validation < 1.0:
            raise ConfigError(f"validation as a fraction must be in [0, 1), got {validation}")
        self._check_framework()

    def _store(self) -> Store:
        store = self.value("store")
        if store is None:
            store = tempfile.mkdtemp(prefix="hvd_spark_store_")
            log.warning("no store given: using the local directory %s (set store=... to a "
                        "path every executor can reach on a real cluster)", store)
            self._set(store=store)
        return Store.create(store) if not isinstance(store, Store) else store

    def _fit(self, df):
        from hvd_spark.data import writer
        from hvd_spark.runner.api import run

        self._check_params()
        spark = df.sparkSession
        num_proc = self.value("numProc") or spark.sparkContext.defaultParallelism
        store = self._store()
        # A generated id is not stored on the estimator: fitting it again starts afresh.
        run_id = self.value("runId") or f"run_{uuid.uuid4().hex[:12]}"
        dataset = writer.prepare_data(
            df, store,
            feature_cols=self.value("featureCols"),
            label_cols=self.value("labelCols"),
            sample_weight_col=self.value("sampleWeightCol"),
            validation=self.value("validation"),
            num_proc=num_proc,
            batch_size=self.value("batchSize"),
            val_batch_size=self.value("valBatchSize"),
            partitions_per_process=self.value("partitionsPerProcess"),
            seed=self.value("randomSeed"),
        )
        start_epoch = self._resume_epoch(store, run_id)
        spec = TrainSpec(
            dataset=dataset, store=store, run_id=run_id,
            batch_size=self.value("batchSize"),
            val_batch_size=self.value("valBatchSize") or self.value("batchSize"),
            epochs=self.value("epochs"), start_epoch=start_epoch,
            shuffle=self.value("shuffle"), seed=self.value("randomSeed"),
            train_steps=self.value("trainStepsPerEpoch"),
            val_steps=self.value("validationStepsPerEpoch"),
            backward_passes_per_step=self.value("backwardPassesPerStep"),
            compression=self.value("gradientCompression"),
            verbose=self.value("verbose"), use_gpu=self.value("useGpu"),
            extra=self._extra(),
        )
        stdout = None
        if self.value("verbose") >= 1 and progress.in_notebook():
            stdout = progress.NotebookProgress(spec.epochs)
        results = run(self._worker(), args=(spec, self._payload()), num_proc=num_proc,
                      env=self._worker_env(), stdout=stdout, use_gpu=self.value("useGpu"),
                      verbose=self.value("verbose"))
        return self._make_model(results[0], run_id)

    def _resume_epoch(self, store: Store, run_id: str) -> int:
        epochs = store.list_checkpoints(run_id)
        if not epochs:
            return 0
        log.info("run %s: resuming after the checkpoint of epoch %d", run_id, epochs[-1] + 1)
        return epochs[-1] + 1

    def _make_model(self, result: dict, run_id: str) -> HvdModel:
        model = self._model_class()()
        params = {p: self.value(p) for p in MODEL_PARAMS if self.value(p) is not None}
        model._set(**params)
        model._set_trained(result["model"], result["history"], result.get("output_shapes", []),
                           run_id)
        return model

    def _init_empty(self) -> None:
        KeywordParams.__init__(self)


class HvdModel(Model, KeywordParams, PickledPersistence):
    """A trained model; ``transform`` adds prediction columns with batched inference."""

    _param_specs = [s for s in SHARED_PARAMS if s[0] in MODEL_PARAMS]

    def __init__(self) -> None:
        super().__init__()
        self.model_bytes = b""
        self.history: list[dict] = []
        self.output_shapes: list[tuple[int, ...]] = []
        self.run_id = ""

    def _set_trained(self, model_bytes: bytes, history: list[dict],
                     output_shapes: list, run_id: str) -> None:
        self.model_bytes = model_bytes
        self.history = list(history)
        self.output_shapes = [tuple(s) for s in output_shapes]
        self.run_id = run_id

    def getHistory(self) -> list[dict]:  # noqa: N802 - Spark ML naming
        """Per-epoch metrics: ``[{"epoch": 1, "loss": ..., "val_loss": ...}, ...]``."""
        return [dict(h) for h in self.history]

    def output_columns(self) -> list[str]:
        """Prediction column names: ``outputCols`` or ``<label>__output``."""
        return self.value("outputCols") or [f"{c}__output" for c in self.value("labelCols")]

    def _predictor_factory(self) -> Callable[[bytes], Callable]:
        """Module-level function: model bytes -> ``predict(list of arrays) -> list of arrays``."""
        raise NotImplementedError

    def _transform(self, df):
        return transform.predict_columns(
            df, self.value("featureCols"), self.output_columns(), self.output_shapes,
            self.model_bytes, self._predictor_factory(), self.value("batchSize"))

    def _init_empty(self) -> None:
        HvdModel.__init__(self)

    def _persisted_blobs(self) -> dict[str, bytes]:
        import json

        meta = {"history": self.history, "output_shapes": self.output_shapes,
                "run_id": self.run_id}
        return {"model.bin": self.model_bytes, "trained.json": json.dumps(meta).encode()}

    def _blob_names(self) -> list[str]:
        return ["model.bin", "trained.json"]

    def _restore_blobs(self, blobs: dict[str, bytes]) -> None:
        import json

        meta = json.loads(blobs["trained.json"])
        self._set_trained(blobs["model.bin"], meta["history"], meta["output_shapes"],
                          meta["run_id"])


def define(cls: type, extra_specs: list) -> type:
    """Give an estimator class its Params (shared + framework extras) and accessors."""
    cls._param_specs = SHARED_PARAMS + extra_specs
    return define_params(cls, cls._param_specs)


define_params(HvdEstimator, SHARED_PARAMS)
define_params(HvdModel, HvdModel._param_specs)
