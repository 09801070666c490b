"""Spark ML Params of the estimators and models: the only camelCase in the codebase.

Constructors take Horovod's snake_case keywords (``num_proc=2``); each maps to a
Param (``numProc``) with ``setNumProc`` / ``getNumProc`` accessors, as Spark ML
users expect.
"""

from __future__ import annotations

import re
from typing import Any

from pyspark.ml.param import Param, Params, TypeConverters

from hvd_spark.errors import ConfigError

_ANY = None  # Python objects (models, optimizers, stores) are kept as they are.

# (Param name, doc, converter, default)
SHARED_PARAMS: list[tuple[str, str, Any, Any]] = [
    ("numProc", "number of ranks (default: the cluster's task slots)", TypeConverters.toInt, None),
    ("model", "the model to train (framework object)", _ANY, None),
    ("optimizer", "the optimizer (framework object)", _ANY, None),
    ("loss", "loss function(s)", _ANY, None),
    ("metrics", "metrics to report per epoch", _ANY, None),
    ("featureCols", "feature column names", TypeConverters.toListString, None),
    ("labelCols", "label column names", TypeConverters.toListString, None),
    ("batchSize", "rows per batch on each rank", TypeConverters.toInt, 32),
    ("valBatchSize", "rows per validation batch (default: batchSize)", TypeConverters.toInt, None),
    ("epochs", "number of epochs", TypeConverters.toInt, 1),
    ("validation", "fraction of rows (0..1) or name of a 0/1/bool column", _ANY, None),
    ("callbacks", "framework callbacks run on every rank", _ANY, None),
    ("store", "Store (or path/URL) for data, checkpoints and logs", _ANY, None),
    ("runId", "run id; a second fit with the same id resumes", TypeConverters.toString, None),
    ("shuffle", "shuffle rows every epoch", TypeConverters.toBoolean, True),
    ("randomSeed", "seed for shuffling, splitting and initialization", TypeConverters.toInt, 0),
    ("verbose", "0: quiet, 1: a line per epoch on the driver", TypeConverters.toInt, 1),
    ("sampleWeightCol", "column of per-row loss weights", TypeConverters.toString, None),
    ("trainStepsPerEpoch", "training batches per epoch (default: all rows)",
     TypeConverters.toInt, None),
    ("validationStepsPerEpoch", "validation batches per epoch (default: all rows)",
     TypeConverters.toInt, None),
    ("partitionsPerProcess", "Parquet files written per rank", TypeConverters.toInt, 4),
    ("gradientCompression", "Compression.none or Compression.fp16", _ANY, None),
    ("backwardPassesPerStep", "batches accumulated before each allreduce",
     TypeConverters.toInt, 1),
    ("useGpu", "give each rank its task's GPU", TypeConverters.toBoolean, False),
    ("outputCols", "prediction column names (default: <label>__output)",
     TypeConverters.toListString, None),
]

#: Params a fitted model keeps and saves as JSON.
MODEL_PARAMS = ("featureCols", "labelCols", "outputCols", "batchSize")


def snake(name: str) -> str:
    """``numProc`` -> ``num_proc``."""
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name)


def define_params(cls: type, specs: list[tuple[str, str, Any, Any]]) -> type:
    """Attach each Param and its ``setX``/``getX`` accessors to ``cls``."""
    for name, doc, converter, _ in specs:
        param = Param(Params._dummy(), name, doc, typeConverter=converter)
        setattr(cls, name, param)
        upper = name[0].upper() + name[1:]

        def setter(self, value, _name=name):
            return self._set(**{_name: value})

        def getter(self, _name=name):
            return self.getOrDefault(getattr(self, _name))

        setter.__doc__ = f"Set {name}: {doc}."
        getter.__doc__ = f"Get {name}: {doc}."
        setattr(cls, f"set{upper}", setter)
        setattr(cls, f"get{upper}", getter)
    return cls


class KeywordParams(Params):
    """Params set from snake_case keywords, with defaults from the class's spec list."""

    _param_specs: list[tuple[str, str, Any, Any]] = []

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(**{name: default for name, _, _, default in self._param_specs})

    def set_keywords(self, kwargs: dict[str, Any]) -> None:
        """Set Params from Horovod-style keywords; unknown ones are a ConfigError."""
        known = {snake(name): name for name, *_ in self._param_specs}
        unknown = sorted(k for k in kwargs if k not in known)
        if unknown:
            raise ConfigError(
                f"{type(self).__name__} got unknown parameter(s) {unknown}; "
                f"known: {sorted(known)}"
            )
        self._set(**{known[k]: v for k, v in kwargs.items() if v is not None})

    def value(self, name: str) -> Any:
        """The Param's value (set or default) by its camelCase name."""
        return self.getOrDefault(getattr(self, name))
