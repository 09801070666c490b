"""MLflow dataset lineage: a run that trains on a DataFrame logs it as the run's input.

When the driver has an active MLflow run, ``hvd_spark.run(fn, df=...)`` logs ``df`` with
``mlflow.log_input``: its schema, digest and source. The source is the catalog table the
DataFrame reads (with its version for a Delta table, as MLflow finds it), else the
directory of the files it reads, else the code that built it (MLflow's default). MLflow is
never imported here unless the driver did; lineage never fails a run (a warning instead).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

log = logging.getLogger("hvd_spark.runner")

# The analysed plan of spark.table("db.t") names the table: "SubqueryAlias spark_catalog.db.t".
_TABLE = re.compile(r"SubqueryAlias (spark_catalog\.[\w.`]+)")


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


def log_dataframe_input(df: Any, context: str = "training") -> bool:
    """Log ``df`` as an input of the driver's active MLflow run; True when logged.

    Args:
        df: The DataFrame the run trains on.
        context: MLflow's input context tag (``training``, ``validation``, ...).
    """
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return False
    try:
        if mlflow.active_run() is None:
            return False
        import mlflow.data

        dataset = mlflow.data.from_spark(df, **dataset_source(df))
        mlflow.log_input(dataset, context=context)
        return True
    except Exception:  # noqa: BLE001 - lineage must never stop a run
        log.warning("could not log the DataFrame as an MLflow input of the active run",
                    exc_info=True)
        return False
