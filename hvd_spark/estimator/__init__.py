"""Spark ML Estimators that train with hvd_spark: ``TorchEstimator``, ``KerasEstimator``,
``LightningEstimator`` (also as ``hvd_spark.estimator.lightning.TorchEstimator``, Horovod's name).

``SparkBackend`` (and the ``Backend`` base) are re-exported from ``hvd_spark.runner``, so
Horovod's ``backend=SparkBackend(...)`` works with the Estimators' import.

Importing this package needs pyspark but neither torch, TensorFlow nor Lightning.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "Backend", "KerasEstimator", "KerasModel", "LightningEstimator", "LightningModel",
    "SparkBackend", "TorchEstimator", "TorchModel",
]


def __getattr__(name: str) -> Any:
    if name in ("TorchEstimator", "TorchModel"):
        from hvd_spark.estimator import torch as torch_adapter

        return getattr(torch_adapter, name)
    if name in ("KerasEstimator", "KerasModel"):
        from hvd_spark.estimator import keras as keras_adapter

        return getattr(keras_adapter, name)
    if name in ("LightningEstimator", "LightningModel"):
        from hvd_spark.estimator import lightning as lightning_adapter

        return getattr(lightning_adapter, name)
    if name in ("Backend", "SparkBackend"):
        from hvd_spark.runner import backend

        return getattr(backend, name)
    raise AttributeError(f"module 'hvd_spark.estimator' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names too, so that dir() and star-import style copies see them.
    return sorted({*globals(), *__all__})
