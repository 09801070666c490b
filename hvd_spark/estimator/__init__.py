"""Spark ML Estimators that train with hvd_spark: ``TorchEstimator``, ``KerasEstimator``.

Importing this package needs pyspark but neither torch nor TensorFlow.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KerasEstimator", "KerasModel", "TorchEstimator", "TorchModel"]


def __getattr__(name: str) -> Any:
    if name in ("TorchEstimator", "TorchModel"):
        from hvd_spark.estimator import torch as torch_adapter

        return getattr(torch_adapter, name)
    if name in ("KerasEstimator", "KerasModel"):
        from hvd_spark.estimator import keras as keras_adapter

        return getattr(keras_adapter, name)
    raise AttributeError(f"module 'hvd_spark.estimator' has no attribute {name!r}")
