"""MLflow tracking of Estimator fits: params, per-epoch metrics, tags, logs and the Model.

A fit is tracked when MLflow is importable and it is asked for: ``mlflow=True`` on the
Estimator, or (``mlflow=None``, the default) a run is active, or ``mlflow.autolog()`` /
``mlflow.pyspark.ml.autolog()`` is on; ``mlflow=False`` turns it off. Then:

- the active run receives the fit; with none, the fit starts (and ends) its own run;
- under ``CrossValidator`` / ``TrainValidationSplit`` (``fitMultiple``) each fit is a
  nested child run of the tuning run; the final refit of the best map, which Spark ML
  runs with a plain ``fit``, lands in the tuning run itself;
- params are logged readably (``optimizer``: ``SGD``, ``optimizer.lr``: ``0.1``;
  ``model``: ``MLP``, ``model_parameters``: ``1153``; ``loss``: ``mse_loss``), the
  per-epoch metrics as rank 0 reports them to the driver (``step`` = the epoch, counted
  from 1 as on the console and in TensorBoard), hvd_spark's ``run_id`` and Store as tags,
  the run's logs directory (TensorBoard events, per-rank logs) as the ``logs`` artifact
  and the fitted Model as the pyfunc model ``model`` (``hvd_spark.estimator.mlflow_model``).

Our Estimators fit outside ``mlflow.pyspark.ml.autolog``'s patch of ``Estimator.fit``
(which would log every Param as its repr string and no metric): ``TrackedFit.fit`` is
pyspark's ``Estimator.fit`` with this module's tracking around it.

MLflow is imported only when it is in use. A failure to log is a warning, never a
failed fit.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from hvd_spark.errors import ConfigError
from hvd_spark.estimator.tracking_params import estimator_params

log = logging.getLogger("hvd_spark.estimator")

_BAD_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")


@dataclasses.dataclass(frozen=True)
class TuningParent:
    """The run a ``fitMultiple`` call was made under; its fits nest under it."""

    run_id: str
    experiment_id: str
    index: int = 0
    count: int = 0


_CURRENT: contextvars.ContextVar[FitRun | None] = contextvars.ContextVar(
    "hvd_spark_fit_run", default=None)
_PARENT: contextvars.ContextVar[TuningParent | None] = contextvars.ContextVar(
    "hvd_spark_tuning_parent", default=None)


def current() -> FitRun | None:
    """The tracked run of the fit running in this thread, if any."""
    return _CURRENT.get()


# ---------------------------------------------------------------- the run of one fit


class FitRun:
    """The MLflow run one fit logs to (the fit's thread has it as the active run).

    Args:
        mlflow: The imported ``mlflow`` module.
        run_id: The MLflow run.
        own: Whether this fit started the run (and so ends it).
        log_models: Whether to log the fitted Model.
    """

    def __init__(self, mlflow: Any, run_id: str, own: bool, log_models: bool) -> None:
        self._mlflow = mlflow
        self.run_id = run_id
        self.own = own
        self.log_models = log_models
        self._client = mlflow.MlflowClient(mlflow.get_tracking_uri())
        self._store: Any = None
        self._hvd_run_id: str | None = None
        self._dataset: Any = None
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def _warn(self, what: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("MLflow: could not %s (run %s); training goes on", what, self.run_id,
                        exc_info=True)

    def log_params(self, params: dict[str, Any], tags: dict[str, str] | None = None) -> None:
        """Log ``params`` (and ``tags``) in one batch, keeping values the run already holds
        (MLflow refuses to change a param)."""
        try:
            from mlflow.entities import Param, RunTag

            have = self._client.get_run(self.run_id).data.params
            clash = sorted(k for k, v in params.items() if k in have and have[k] != str(v))
            if clash:
                log.warning("MLflow run %s already holds the params %s with other values "
                            "(an earlier fit in the same run?): kept those; fit in a run of "
                            "its own, e.g. mlflow.start_run(nested=True)", self.run_id, clash)
            items = [Param(k, str(v)) for k, v in params.items() if k not in have]
            run_tags = [RunTag(k, v) for k, v in (tags or {}).items()]
            for start in range(0, max(len(items), 1), 100):  # MLflow's batch limit
                self._client.log_batch(self.run_id, params=items[start : start + 100],
                                       tags=run_tags if start == 0 else [])
        except Exception:  # noqa: BLE001 - see _warn
            self._warn("log the params")

    def started(self, hvd_run_id: str, store: Any, dataset: Any, num_proc: int,
                df: Any = None, direct: bool = False) -> None:
        """The fit's hvd_spark run id, Store and data are known: tags, a few params, and
        the training DataFrame ``df`` as the run's input (lineage).

        Args:
            hvd_run_id: The fit's run id (its checkpoints and logs directory).
            store: The Store of the logs (on the direct path, a local one for them only).
            dataset: What the fit trains on.
            num_proc: Number of ranks.
            df: The user's training DataFrame, if the fit has one.
            direct: The ranks read ``df`` from their tasks, with no Store.
        """
        self._store, self._hvd_run_id, self._dataset = store, hvd_run_id, dataset
        tags = {"hvd_spark.run_id": hvd_run_id, "hvd_spark.data": "direct" if direct else "store",
                "hvd_spark.logs": store.url_of(store.logs_path(hvd_run_id))}
        if not direct:
            tags["hvd_spark.store"] = store.url
        self.log_params(
            {"num_proc": num_proc, "train_rows": dataset.train.num_rows,
             "val_rows": dataset.val.num_rows}, tags=tags)
        if df is not None:
            from hvd_spark.runner import mlflow_inputs

            # Validation rows are a split of the same DataFrame, and MLflow keeps one input
            # per dataset and run: the split is a tag of the training input.
            validation = dataset.settings.get("validation")
            tags = {} if validation is None else {"hvd_spark.validation":
                                                  _describe_split(validation)}
            mlflow_inputs.log_dataframe_input(df, "training", self.run_id, tags=tags)

    def log_epoch(self, epoch: int, metrics: dict[str, Any]) -> None:
        """Rank 0's metrics of one epoch (called on the driver as they arrive)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(_BAD_KEY.sub("_", k), float(v), now, int(epoch))
                 for k, v in metrics.items()
                 if k != "epoch" and isinstance(v, (int, float)) and not isinstance(v, bool)]
        if not items:
            return
        with self._lock:  # the driver service's thread; keep epochs in order
            try:
                self._client.log_batch(self.run_id, metrics=items)
            except Exception:  # noqa: BLE001 - see _warn
                self._warn("log the epoch metrics")

    def log_logs(self) -> None:
        """The run's logs directory in the Store (TensorBoard events, rank logs) as the
        ``logs`` artifact."""
        if self._store is None:
            return
        from pyarrow import fs as pafs

        try:
            store, root = self._store, self._store.path(self._store.logs_path(self._hvd_run_id))
            infos = store.filesystem.get_file_info(
                pafs.FileSelector(root, recursive=True, allow_not_found=True))
            files = [i for i in infos if i.type == pafs.FileType.File]
            if not files:
                return
            with tempfile.TemporaryDirectory(prefix="hvd_spark_logs_") as tmp:
                for info in files:
                    local = os.path.join(tmp, os.path.relpath(info.path, root))
                    os.makedirs(os.path.dirname(local), exist_ok=True)
                    with store.filesystem.open_input_stream(info.path) as src, \
                            open(local, "wb") as out:
                        out.write(src.read())
                self._client.log_artifacts(self.run_id, tmp, "logs")
        except Exception:  # noqa: BLE001 - see _warn
            self._warn("log the logs directory")

    def log_model(self, model: Any, df: Any = None) -> None:
        """The fitted Model as the pyfunc model ``model`` of the run."""
        if not self.log_models:
            return
        try:
            from hvd_spark.estimator import mlflow_model

            mlflow_model.log_model(model, df=df, dataset=self._dataset)
        except Exception:  # noqa: BLE001 - see _warn
            self._warn("log the model")

    def end(self, status: str) -> None:
        """End the run if this fit started it."""
        if self.own:
            try:
                self._mlflow.end_run(status)
            except Exception:  # noqa: BLE001 - see _warn
                self._warn("end the run")


def _mode(estimator: Any) -> bool | None:
    mode = estimator.value("mlflow") if estimator.hasParam("mlflow") else None
    if mode not in (None, True, False):
        raise ConfigError(f"mlflow must be True (track the fit), False (never) or None "
                          f"(track when a run is active or autolog is on), got {mode!r}")
    return mode


def _import_mlflow(mode: bool | None) -> Any:
    if mode is None:
        # Not imported: no run can be active and autolog cannot be on.
        return sys.modules.get("mlflow")
    try:
        import mlflow
    except ImportError as exc:
        raise ConfigError("mlflow=True needs MLflow's tracking client: pip install "
                          "'hvd-spark[mlflow]' (or mlflow-skinny)") from exc
    return mlflow


def _autolog(option: str, default: Any) -> Any:
    """An option of ``mlflow.pyspark.ml.autolog`` (which ``mlflow.autolog`` turns on too);
    ``disable`` is True when autolog is off."""
    try:
        from mlflow.utils.autologging_utils import get_autologging_config

        return get_autologging_config("pyspark.ml", option, default)
    except Exception:  # noqa: BLE001 - an MLflow without the helper: autolog is off
        return default


def begin(estimator: Any) -> FitRun | None:
    """The run this fit logs to (started here when needed), its params logged; or None.

    Raises:
        ConfigError: ``mlflow`` is not None/True/False, or True without MLflow installed.
    """
    mode = _mode(estimator)
    if mode is False:
        return None
    mlflow = _import_mlflow(mode)
    if mlflow is None:
        return None
    parent, active = _PARENT.get(), mlflow.active_run()
    autolog = not _autolog("disable", True)
    if mode is None and not (parent or active or autolog):
        return None
    log_models = bool(_autolog("log_models", True)) if autolog else True
    name = type(estimator).__name__
    tags = {"hvd_spark.estimator": name}
    try:
        if parent is not None:
            # A fit of fitMultiple, maybe on a tuning pool's thread: a child of the run
            # fitMultiple was called under (this thread has no active run of its own).
            tags["hvd_spark.param_map_index"] = str(parent.index)
            run = mlflow.start_run(
                experiment_id=parent.experiment_id, parent_run_id=parent.run_id,
                nested=True, tags=tags,
                run_name=f"{name} param map {parent.index + 1}/{parent.count}")
            tracked = FitRun(mlflow, run.info.run_id, own=True, log_models=log_models)
        elif active is not None:
            tracked = FitRun(mlflow, active.info.run_id, own=False, log_models=log_models)
        else:
            run = mlflow.start_run(tags=tags)
            tracked = FitRun(mlflow, run.info.run_id, own=True, log_models=log_models)
    except Exception:  # noqa: BLE001 - the fit runs untracked rather than not at all
        log.warning("MLflow: could not start or open a run; the fit is not tracked",
                    exc_info=True)
        return None
    tracked.log_params(estimator_params(estimator), tags={"hvd_spark.estimator": name})
    return tracked


@contextlib.contextmanager
def fit_tracking(estimator: Any) -> Iterator[FitRun | None]:
    """Track the fit run inside: the run is ``current()`` in this thread; it ends with
    the fit (FAILED on an error, KILLED on an interrupt) when the fit started it."""
    tracked = begin(estimator)
    token = _CURRENT.set(tracked)
    try:
        yield tracked
    except KeyboardInterrupt:
        if tracked is not None:
            tracked.end("KILLED")
        raise
    except BaseException:
        if tracked is not None:
            tracked.end("FAILED")
        raise
    else:
        if tracked is not None:
            tracked.end("FINISHED")
    finally:
        _CURRENT.reset(token)


def run_tracked(estimator: Any, fit: Any, df: Any = None) -> Any:
    """``fit()`` (which returns the Model) tracked for ``estimator``; the Model logged.

    Args:
        estimator: The Estimator being fitted (its params are logged).
        fit: A function of no arguments doing the fit.
        df: The training DataFrame, whose schema makes the logged model's signature.
    """
    with fit_tracking(estimator) as tracked:
        model = fit()
        if tracked is not None:
            tracked.log_model(model, df)
    return model


def epoch_hook() -> Any:
    """The current run's per-epoch logger for ``RunRecord`` (None when untracked)."""
    tracked = current()
    return None if tracked is None else tracked.log_epoch


def fit_started(hvd_run_id: str, store: Any, dataset: Any, num_proc: int, df: Any = None,
                direct: bool = False) -> None:
    """Tell the current run (if any) the fit's run id, Store, data and ranks (see
    ``FitRun.started``)."""
    tracked = current()
    if tracked is not None:
        tracked.started(hvd_run_id, store, dataset, num_proc, df, direct)


def _describe_split(validation: Any) -> str:
    """``fraction 0.2`` or ``column is_val``: how the validation rows are chosen."""
    if isinstance(validation, str):
        return f"column {validation}"
    return f"fraction {validation}"


def fit_ran() -> None:
    """The ranks are done (or failed): the current run (if any) gets the logs directory."""
    tracked = current()
    if tracked is not None:
        tracked.log_logs()


def tuning_parent() -> TuningParent | None:
    """The active run of this thread, as the parent of ``fitMultiple``'s fits."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return None
    try:
        run = mlflow.active_run()
    except Exception:  # noqa: BLE001 - no parent: each fit decides alone
        return None
    return None if run is None else TuningParent(run.info.run_id, run.info.experiment_id)


class TrackedFit:
    """``fit`` and ``fitMultiple`` of Spark ML's Estimator, with MLflow tracking.

    Mixed in before ``pyspark.ml.Estimator``: these methods are not the ones
    ``mlflow.pyspark.ml.autolog`` patches, so an autolog-managed run does not log our
    Estimators' Params as repr strings next to ours.
    """

    def fit(self, dataset: Any, params: Any = None) -> Any:
        """Fit a model to ``dataset`` (Spark ML's ``Estimator.fit``; see the module doc
        for what is logged to MLflow).

        Args:
            dataset: The training DataFrame.
            params: A param map overriding this Estimator's params, or a list/tuple of
                them (one model each, through ``fitMultiple``).
        """
        if isinstance(params, (list, tuple)):
            models: list[Any] = [None] * len(params)
            for index, model in self.fitMultiple(dataset, params):
                models[index] = model
            return models
        if params is not None and not isinstance(params, dict):
            raise TypeError(f"Params must be either a param map or a list/tuple of param "
                            f"maps, but got {type(params)}.")
        estimator = self.copy(params) if params else self
        return run_tracked(estimator, lambda: estimator._fit(dataset), dataset)

    def fitMultiple(self, dataset: Any, paramMaps: Any) -> Any:  # noqa: N802, N803 - Spark ML
        """Spark ML's ``fitMultiple``; each fit is a child run of the active MLflow run."""
        from pyspark.ml.base import _FitMultipleIterator

        estimator = self.copy()
        parent = tuning_parent()  # read here: the fits may run on a tuning pool's threads

        def fit_one(index: int) -> Any:
            token = _PARENT.set(None if parent is None else dataclasses.replace(
                parent, index=index, count=len(paramMaps)))
            try:
                return estimator.fit(dataset, paramMaps[index])
            finally:
                _PARENT.reset(token)

        return _FitMultipleIterator(fit_one, len(paramMaps))
