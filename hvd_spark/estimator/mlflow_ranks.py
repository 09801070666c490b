"""On a rank: Lightning's ``MLFlowLogger`` nests under the driver's MLflow run.

``hvd_spark.run`` gives every rank the driver's active run as ``MLFLOW_RUN_ID`` (with
``MLFLOW_TRACKING_URI`` and ``MLFLOW_EXPERIMENT_ID``; see
``hvd_spark.runner.mlflow_env``). A user's ``MLFlowLogger`` without a run of its own
would otherwise open a separate, unrelated run from rank 0 (in experiment
``lightning_logs``, in ``./mlruns`` of the task's directory when no tracking URI was
given); here it becomes a child run of the fit's run instead.

Runs on the ranks: neither pyspark nor Lightning is imported.
"""

from __future__ import annotations

import os
from typing import Any

_PARENT_TAG = "mlflow.parentRunId"
# MLFlowLogger's defaults: a logger still holding them was not pointed anywhere.
_DEFAULT_URI = "file:./mlruns"
_DEFAULT_EXPERIMENT = "lightning_logs"


def nest_mlflow_logger(logger: Any) -> None:
    """Make each ``MLFlowLogger`` in ``logger`` (one logger or a list) that has no run id
    a child of the run in ``MLFLOW_RUN_ID``: the parent tag, the parent's experiment and
    tracking URI where the user left Lightning's defaults. Other loggers are untouched.
    """
    parent = os.environ.get("MLFLOW_RUN_ID")
    if not parent or logger is None:
        return
    for one in logger if isinstance(logger, (list, tuple)) else [logger]:
        if type(one).__name__ != "MLFlowLogger" or getattr(one, "_run_id", True) is not None:
            continue
        one.tags = {_PARENT_TAG: parent, **(one.tags or {})}
        experiment = os.environ.get("MLFLOW_EXPERIMENT_ID")
        if experiment and one._experiment_id is None \
                and one._experiment_name == _DEFAULT_EXPERIMENT:
            one._experiment_id = experiment
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri and one._tracking_uri == _DEFAULT_URI:
            from mlflow.tracking import MlflowClient

            one._tracking_uri = uri
            one._mlflow_client = MlflowClient(uri)
