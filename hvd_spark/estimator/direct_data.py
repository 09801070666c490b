"""The Estimators' direct path: ``fit(df)`` without a Store trains on the DataFrame's rows
as the ranks' Spark tasks hand them over (``hvd_spark.run(fn, df=...)``), nothing written.

The driver checks the DataFrame exactly as the Store path does (``data.inspection``: the
columns, nulls, NaN, array lengths, enough rows for a batch per rank, the validation
split), then passes the selected columns with the validation marker to the launcher.
What is lost without a Store: checkpoints. A retry after a lost executor starts over
from the first epoch, which ``warn_once`` says once per driver process. The driver's
own records (rank logs, TensorBoard events) go to a local directory.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import tempfile
import threading
from typing import Any

from hvd_spark.data.inspection import VAL_COL, inspect_dataframe
from hvd_spark.data.spec import DatasetSpec, SplitSpec
from hvd_spark.data.store import Store
from hvd_spark.errors import ConfigError

log = logging.getLogger("hvd_spark.estimator")

_WARNED = threading.Event()


def warn_once() -> None:
    """Say, once per process, what a fit without a Store gives up."""
    if not _WARNED.is_set():
        _WARNED.set()
        log.warning("fit without a store: the ranks read the DataFrame straight from their "
                    "Spark tasks and no checkpoint is written, so a retry after a lost "
                    "executor starts over from epoch 1; set store=... (a path every "
                    "executor can reach) to resume from the last checkpoint instead")


def check_backend(backend: Any) -> None:
    """Refuse a backend that cannot hand the ranks their rows, before any Spark job.

    Raises:
        ConfigError: ``backend.run`` takes no ``df``.
    """
    try:
        takes_df = "df" in inspect.signature(backend.run).parameters
    except (TypeError, ValueError):
        takes_df = False
    if not takes_df:
        raise ConfigError(
            f"backend {type(backend).__name__} cannot hand a DataFrame's rows to its ranks "
            "(its run() takes no df=): set store=... to a path every rank can read, or use "
            "SparkBackend")


def prepare(estimator: Any, df: Any, num_proc: int) -> tuple[DatasetSpec, Any]:
    """The dataset's description and the DataFrame the ranks' tasks hand over.

    Args:
        estimator: The Estimator being fitted (its column, batch and validation params).
        df: The training DataFrame.
        num_proc: Number of ranks.

    Returns:
        ``(spec, rows)``: a ``DatasetSpec`` without files (columns with their shapes, the
        rows of each split) and the selected columns with the validation marker.

    Raises:
        ConfigError, DataError: As the Store path's checks (naming the column).
    """
    seed = estimator.value("random_seed")
    found = inspect_dataframe(
        df, feature_cols=estimator.value("feature_cols"),
        label_cols=estimator.value("label_cols"),
        sample_weight_col=estimator.value("sample_weight_col"),
        validation=estimator.value("validation"), num_proc=num_proc,
        batch_size=estimator.value("batch_size"),
        val_batch_size=estimator.value("val_batch_size"), seed=0 if seed is None else seed)
    digest = hashlib.sha256(f"{found.fingerprint}/{found.rows}".encode()).hexdigest()[:24]
    spec = DatasetSpec(
        key=f"dataframe-{digest}", root_url="", columns=tuple(found.columns),
        feature_cols=tuple(found.feature_cols), label_cols=tuple(found.label_cols),
        sample_weight_col=found.sample_weight_col,
        train=SplitSpec(num_rows=found.train_rows), val=SplitSpec(num_rows=found.val_rows),
        settings={"validation": estimator.value("validation"), "rows": found.rows,
                  "source": "dataframe"})
    rows = found.selected
    if VAL_COL in rows.columns:
        rows = rows.drop(VAL_COL)
    return spec, rows


def logs_store() -> Store:
    """A local directory for the driver's records of the fit (rank logs, TensorBoard)."""
    path = tempfile.mkdtemp(prefix="hvd_spark_fit_logs_")
    log.info("fit without a store: the ranks' logs and TensorBoard events go to %s", path)
    return Store.create(path)
