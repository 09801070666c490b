"""Fit retries: a rank lost with its process or executor resumes from the last checkpoint.

A barrier job cannot lose a task and go on, so the fit runs the job again: on the
same stored data shards, from the newest epoch or step checkpoint of the run (without a
Store: on the DataFrame again, from the first epoch), with as many ranks as before once
the cluster has the task slots again (Spark's standalone and YARN managers replace a
lost executor), or with the slots that remain after a deadline. Only losses are retried:
an exception raised by the training code (a bug, a NaN loss, bad data) would fail
again, so it ends the fit at once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from hvd_spark.errors import WorkerFailedError
from hvd_spark.estimator.step_checkpoints import ResumePoint, resume_point
from hvd_spark.estimator.train_spec import TrainSpec
from hvd_spark.runner import mlflow_inputs
from hvd_spark.runner.backend import Backend

log = logging.getLogger("hvd_spark.estimator")

#: How long a retry waits for the cluster to have as many task slots as the first run.
SLOT_WAIT_S = 90.0


def recoverable(err: WorkerFailedError) -> bool:
    """True when every failure that is not a consequence is a lost process or executor."""
    primary = [f for f in err.failures if not f.secondary]
    return bool(err.failures) and all(getattr(f, "lost", False) for f in primary)


def describe_loss(err: WorkerFailedError) -> str:
    """``rank 1 on host X lost: executor 3 lost (...)`` for the driver's log."""
    root = err.root_cause
    return f"rank {root.rank} on host {root.host} lost: {root.message}"


def run_with_retries(backend: Backend, worker: Callable, spec: TrainSpec, payload: Any,
                     env: dict[str, str], max_retries: int, rows: Any = None) -> list:
    """Run ``worker(spec, payload)`` on every rank; after a lost rank, resume and go on.

    Args:
        backend: Where the ranks run.
        worker: The training function.
        spec: The run's spec; each attempt starts from the run's newest checkpoint
            (without a Store, ``spec.store`` None, from the first epoch).
        payload: The serialized model and its companions.
        env: Environment variables of the ranks.
        max_retries: How many times a lost rank may be recovered from (0: never).
        rows: The DataFrame the ranks' tasks hand over (the direct path), else None.

    Returns:
        The ranks' results of the attempt that finished.

    Raises:
        WorkerFailedError: A failure that is not a loss, or a loss after ``max_retries``
            retries (with a note saying so).
    """
    wanted = backend.num_processes()
    attempt = 0
    data = {} if rows is None else {"df": rows}
    while True:
        point = _resume_point(spec)
        if (point.epoch, point.step) > (spec.start_epoch, spec.start_step):
            spec = dataclasses.replace(spec, start_epoch=point.epoch, start_step=point.step)
        try:
            with mlflow_inputs.logged_by_caller():  # the fit logged the user's DataFrame
                return backend.run(worker, args=(spec, payload), env=env, **data)
        except WorkerFailedError as err:
            if not recoverable(err):
                raise
            if attempt >= max_retries:
                err.add_note(f"hvd_spark: the fit was retried {attempt} time(s) "
                             f"(max_retries={max_retries}); raise max_retries to go on")
                raise
            attempt += 1
            backend = backend.for_retry(wanted, SLOT_WAIT_S)
            point = _resume_point(spec)
            where = (point.describe() if spec.store is not None
                     else "the first epoch (no store: no checkpoint to resume from)")
            log.warning("%s; resuming from %s with %d ranks (retry %d of %d)",
                        describe_loss(err), where, backend.num_processes(),
                        attempt, max_retries)


def _resume_point(spec: TrainSpec) -> ResumePoint:
    """The run's newest checkpoint; the start without a Store."""
    if spec.store is None:
        return ResumePoint(0, 0)
    return resume_point(spec.store, spec.run_id)
