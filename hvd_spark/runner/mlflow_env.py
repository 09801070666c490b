"""The driver's MLflow run, handed to the ranks through their environment.

``hvd_spark.run(fn)`` adds these variables to every rank's environment, so that
``mlflow.log_metric(...)`` on rank 0 lands in the run the notebook has open (what
TorchDistributor arranges on Databricks): MLflow's fluent API resumes the run named by
``MLFLOW_RUN_ID`` on its first call in a process without an active run.

MLflow is never imported here: if the driver has not imported it, no run can be
active and nothing is added.
"""

from __future__ import annotations

import logging
import os
import sys
from urllib.parse import urlsplit

log = logging.getLogger("hvd_spark.runner")

TRACKING_URI = "MLFLOW_TRACKING_URI"
RUN_ID = "MLFLOW_RUN_ID"
EXPERIMENT_ID = "MLFLOW_EXPERIMENT_ID"
# Tracking URIs that are names, not paths.
_NAMED_URIS = ("databricks", "databricks-uc", "uc")


def absolute_tracking_uri(uri: str) -> str:
    """``uri`` with a relative local path made absolute against the driver's directory.

    A rank runs in its Spark task's working directory, where ``sqlite:///mlflow.db``
    or ``./mlruns`` would name another (empty) store.
    """
    parts = urlsplit(uri)
    if parts.scheme == "sqlite" and uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):]
        if path and path != ":memory:" and not path.startswith("/"):
            return "sqlite:///" + os.path.abspath(path)
        return uri
    if parts.scheme == "file" and not parts.netloc and not parts.path.startswith("/"):
        return "file://" + os.path.abspath(parts.path)
    if not parts.scheme and uri and uri not in _NAMED_URIS and not os.path.isabs(uri):
        return os.path.abspath(uri)
    return uri


def driver_env() -> dict[str, str]:
    """The tracking URI, run id and experiment id of the driver's active MLflow run.

    Returns:
        ``{}`` when MLflow is not imported; the tracking URI alone when one was set but
        no run is active; all three variables when a run is active (in this thread).
    """
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return {}
    try:
        from mlflow.tracking._tracking_service.utils import is_tracking_uri_set

        run = mlflow.active_run()
        if run is None and not is_tracking_uri_set():
            return {}
        env = {TRACKING_URI: absolute_tracking_uri(mlflow.get_tracking_uri())}
        if run is not None:
            env[RUN_ID] = run.info.run_id
            env[EXPERIMENT_ID] = run.info.experiment_id
        return env
    except Exception:  # noqa: BLE001 - tracking must never stop a run from starting
        log.warning("could not read the driver's MLflow run; the ranks will not log to it",
                    exc_info=True)
        return {}
