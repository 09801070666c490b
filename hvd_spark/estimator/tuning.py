"""Tuning with Spark ML (``CrossValidator``, ``TrainValidationSplit``, ``fitMultiple``).

- A fitted model carries its Estimator's training Params, as Spark ML models do:
  ``cv_model.bestModel.getEpochs()``, ``getBatchSize()``, ``getLearningRate()``, ... read
  back what won. Not carried (``NOT_CARRIED``): live objects and what the model holds
  under another name (``getModel()`` / ``getOptimizer()`` are the *trained* ones).
- The fits of ``fitMultiple`` with a Store share the prepared Parquet data
  (``hvd_spark.data.writer``: "reusing dataset"); without one, each fit reads the
  DataFrame from Spark (``direct_data``: cache it to read it once).
- Param maps holding Python objects (optimizers, losses, models) save and load with the
  validators: ``param_map_io``, installed on import.
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.param import Param

from hvd_spark.estimator import param_map_io
from hvd_spark.estimator.params import ACCESSOR_ALIASES, camel

param_map_io.install()

#: Estimator Params a fitted model does not carry, and why.
NOT_CARRIED: dict[str, str] = {
    "model": "the model's getModel() is the trained model",
    "optimizer": "the model's getOptimizer() is the trained optimizer (class and settings "
                 "as fitted)",
    "backend": "a live handle on the cluster (not saved with the estimator either)",
    "store": "a live handle on storage (which may hold credentials)",
    "logger": "a live Lightning logger (not saved with the estimator either)",
    "feature_cols": "the model has it as feature_columns (Horovod's name)",
    "label_cols": "the model has it as label_columns (Horovod's name)",
    "output_cols": "the model has it as outputCols (Horovod's name)",
    "run_id": "the model's run_id is the fit's (generated when none was given)",
}


def carried_params(model_cls: type, specs: list[tuple[str, str, Any, Any]],
                   estimator_cls: type) -> list[tuple[str, str, Any, Any]]:
    """``specs`` (the model's own Params) plus the Estimator's that the model carries.

    An Estimator Param is left out when it is in ``NOT_CARRIED``, when the model already
    has a Param of that name (``batch_size``, ``loss``, ... set by the fit itself), or when
    the model class already has its getter (``getHistory``): the model's meaning wins.
    The carried names are recorded on ``model_cls`` for ``carry``.
    """
    own = {name for name, *_ in specs}
    carried = []
    for spec in estimator_cls._param_specs:
        name = spec[0]
        getter = f"get{ACCESSOR_ALIASES.get(name, camel(name))}"
        if (name in NOT_CARRIED or name in own
                or isinstance(getattr(model_cls, name, None), Param)
                or hasattr(model_cls, getter)):
            continue
        carried.append(spec)
    model_cls._carried_params = tuple(name for name, *_ in carried)
    return [*specs, *carried]


def carry(estimator: Any, model: Any) -> None:
    """Set on ``model`` the carried Params that ``estimator`` has set (the defaults are
    the same on both)."""
    for name in getattr(model, "_carried_params", ()):
        if estimator.hasParam(name) and estimator.isSet(getattr(estimator, name)):
            model._set(**{name: estimator.getOrDefault(name)})


def rows_per_call(model: Any) -> int:
    """Rows per model call in ``transform``: ``transform_batch_size``, else the training
    ``batch_size``."""
    return model.value("transform_batch_size") or model.value("batch_size")
