"""hvd_spark: Horovod-style distributed deep learning on Apache Spark, in pure Python.

``hvd_spark.run``, ``hvd_spark.run_elastic``, ``hvd_spark.run_local``, ``TorchDistributor``,
``HorovodRunner``, ``SparkBackend`` and ``get_available_devices`` (:mod:`hvd_spark.task`)
are imported lazily so that importing the
package costs nothing and pulls in no framework.
"""

from __future__ import annotations

from typing import Any

from hvd_spark._version import __version__

__all__ = ["HorovodRunner", "SparkBackend", "TorchDistributor", "__version__",
           "get_available_devices", "run", "run_elastic", "run_local"]


def __getattr__(name: str) -> Any:
    if name == "run_local":
        from hvd_spark.runner.api import run_local

        return run_local
    if name == "run":
        from hvd_spark.runner.api import run

        return run
    if name == "run_elastic":
        from hvd_spark.runner.elastic.elastic_spark import run_elastic

        return run_elastic
    if name == "TorchDistributor":
        from hvd_spark.runner.distributor import TorchDistributor

        return TorchDistributor
    if name == "HorovodRunner":
        from hvd_spark.runner.horovod_runner import HorovodRunner

        return HorovodRunner
    if name == "SparkBackend":
        from hvd_spark.runner.backend import SparkBackend

        return SparkBackend
    if name == "get_available_devices":
        from hvd_spark.task import get_available_devices

        return get_available_devices
    raise AttributeError(f"module 'hvd_spark' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names too: tools that copy a module's names through dir() (such as the
    # `horovod` compatibility alias's `horovod.spark`) must see run, run_elastic, ...
    return sorted(set(globals()) | set(__all__))
