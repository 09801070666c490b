"""MLflow dataset lineage: a run that trains on a DataFrame logs it as the run's input.

When the driver has an active MLflow run, ``hvd_spark.run(fn, df=...)`` logs ``df`` as an
input of it (``mlflow.log_input``'s record): its schema, digest and source; an Estimator's
fit logs its training DataFrame to the fit's run, on the Store path and the direct one.
The source is the catalog table the DataFrame reads (with its version for a Delta table,
as MLflow finds it), else the directory of the files it reads, else the code that built
it (MLflow's default). MLflow is never imported here unless the driver did; lineage
never fails a run (a warning instead).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("hvd_spark.runner")

# The analysed plan of spark.table("db.t") names the table: "SubqueryAlias spark_catalog.db.t".
_TABLE = re.compile(r"SubqueryAlias (spark_catalog\.[\w.`]+)")
_CALLER_LOGS: contextvars.ContextVar[bool] = contextvars.ContextVar("hvd_spark_caller_logs",
                                                                   default=False)


def dataset_source(df: Any) -> dict[str, str]:
    """``{"table_name": ...}`` or ``{"path": ...}`` for ``mlflow.data.from_spark``; ``{}``
    when neither is known (a DataFrame built in code)."""
    try:
        plan = df._jdf.queryExecution().analyzed().toString()  # classic sessions only
    except Exception:  # noqa: BLE001 - Spark Connect has no JVM plan here: try the files
        plan = ""
    found = _TABLE.findall(plan)
    if len(set(found)) == 1:
        return {"table_name": found[0].replace("`", "")}
    try:
        files = df.inputFiles()
    except Exception:  # noqa: BLE001 - not every relation lists its files
        files = []
    if files:
        common = os.path.commonpath([f.split("://", 1)[-1] for f in files])
        scheme = files[0].split("://", 1)[0] + "://" if "://" in files[0] else ""
        if scheme == "file://":
            scheme = ""
        return {"path": scheme + common if scheme else common}
    return {}


def log_dataframe_input(df: Any, context: str = "training", run_id: str | None = None,
                        tags: dict[str, str] | None = None) -> bool:
    """Log ``df`` as an input of an MLflow run; True when logged.

    Args:
        df: The DataFrame the run trains on.
        context: MLflow's input context tag (``training``, ``validation``, ...).
        run_id: The run; default the driver's active run (none: nothing is logged).
        tags: More tags of the input.
    """
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or _CALLER_LOGS.get():
        return False
    try:
        if run_id is None:
            active = mlflow.active_run()
            if active is None:
                return False
            run_id = active.info.run_id
        import mlflow.data
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        dataset = mlflow.data.from_spark(df, **dataset_source(df))
        input_tags = [InputTag(MLFLOW_DATASET_CONTEXT, context),
                      *(InputTag(k, v) for k, v in (tags or {}).items())]
        mlflow.MlflowClient().log_inputs(
            run_id, [DatasetInput(dataset._to_mlflow_entity(), tags=input_tags)])
        return True
    except Exception:  # noqa: BLE001 - lineage must never stop a run
        log.warning("could not log the DataFrame as an MLflow input of run %s", run_id,
                    exc_info=True)
        return False


@contextlib.contextmanager
def logged_by_caller() -> Iterator[None]:
    """Inside, ``log_dataframe_input`` logs nothing: the caller (an Estimator's fit, which
    logs the user's DataFrame) hands ``run`` a DataFrame derived from it."""
    token = _CALLER_LOGS.set(True)
    try:
        yield
    finally:
        _CALLER_LOGS.reset(token)
