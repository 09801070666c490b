"""What a fit keeps on the driver while it runs: the bars, the ranks' logs, TensorBoard.

Everything arrives through ``hvd_spark.run``'s two driver-side hooks, so it works the
same for every framework: ``progress`` (the ranks' structured events) feeds the
progress bars and a TensorBoard event file, ``on_output`` (every line the ranks print)
feeds one log file per rank and stream. All of it lands in the run's logs directory in
the Store (``store.get_logs_path(run_id)``), so after a fit
``tensorboard --logdir <store>/runs/<run_id>`` shows the metrics and
``rank-0.stderr.log`` holds rank 0's tracebacks.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from hvd_spark.data.store import Store
from hvd_spark.estimator.progress import StepRate, TrainingProgress
from hvd_spark.estimator.spark_console import quiet_stage_bar
from hvd_spark.estimator.tensorboard_events import EventFileWriter

log = logging.getLogger(__name__)


def rank_log_name(rank: int, stream: str) -> str:
    """``rank-0.stdout.log``: the file of one rank's stream in the logs directory."""
    return f"rank-{rank}.{stream}.log"


class RankLogs:
    """One file per rank and stream in a Store directory, opened on the first line.

    Args:
        store: The run's Store.
        directory: Store-relative directory of the files.
    """

    def __init__(self, store: Store, directory: str) -> None:
        self._store = store
        self._directory = directory
        self._files: dict[tuple[int, str], Any] = {}
        self._lock = threading.Lock()

    def __call__(self, rank: int, stream: str, line: str) -> None:
        with self._lock:
            out = self._files.get((rank, stream))
            if out is None:
                path = self._store.path(f"{self._directory}/{rank_log_name(rank, stream)}")
                self._store.filesystem.create_dir(self._store.path(self._directory),
                                                  recursive=True)
                out = self._files[(rank, stream)] = \
                    self._store.filesystem.open_output_stream(path)
            out.write(f"{line}\n".encode())
            out.flush()  # readable while the run goes on (local and HDFS stores)

    def close(self) -> None:
        """Close every file (an object store uploads them now)."""
        with self._lock:
            for out in self._files.values():
                out.close()
            self._files.clear()


class RunRecord:
    """The driver's sinks for one fit; give ``progress`` and ``output`` to ``hvd_spark.run``.

    Args:
        store: The run's Store.
        run_id: The run.
        epochs: Epochs of the fit.
        verbose: 1 or more draws the progress bars (and, from the first event to ``close``,
            holds Spark's console stage bar off: ``spark_console``); logs and TensorBoard
            are always kept.
        on_epoch: Also receives ``(epoch, metrics)`` of each epoch (MLflow tracking).
    """

    def __init__(self, store: Store, run_id: str, epochs: int, verbose: int,
                 on_epoch: Callable[[int, dict[str, Any]], None] | None = None) -> None:
        directory = store.logs_path(run_id)
        self.bars = TrainingProgress(epochs) if verbose >= 1 else None
        self._quiet: contextlib.ExitStack | None = None
        self.logs = RankLogs(store, directory)
        self.events = EventFileWriter(store, directory)
        self._lock = threading.Lock()
        self._steps: int | None = None
        self._rate = StepRate()  # from each epoch's first step on, as the bars show it
        self._on_epoch = on_epoch

    def progress(self, rank: int, event: dict[str, Any]) -> None:
        """A progress event from a rank: drawn, and its numbers written for TensorBoard."""
        if self.bars is not None:
            with self._lock:
                if self._quiet is None:  # Spark's stage bar would redraw itself amid ours
                    self._quiet = contextlib.ExitStack()
                    self._quiet.enter_context(quiet_stage_bar())
            self.bars(rank, event)
        with self._lock:
            kind = event.get("kind")
            if kind == "step":
                self._steps = event.get("steps") or self._steps
                step = (event["epoch"] - 1) * (self._steps or 0) + event["step"]
                scalars = {"step/loss": event["loss"]}
                rate = self._rate(event)
                if rate is not None:
                    scalars["step/samples_per_second"] = rate
                self.events.add_scalars(step, scalars)
            elif kind == "epoch":
                self.events.add_scalars(event["epoch"], event.get("metrics") or {})
                if self._on_epoch is not None:
                    self._on_epoch(event["epoch"], event.get("metrics") or {})

    def output(self, rank: int, stream: str, line: str) -> None:
        """One line a rank printed."""
        self.logs(rank, stream, line)

    def _end_quiet(self) -> None:
        with self._lock:
            quiet, self._quiet = self._quiet, contextlib.ExitStack()  # no new one after close
        if quiet is not None:
            quiet.close()

    def close(self) -> None:
        """Close the bars and the files; a failure to close one does not hide the others."""
        for close in ([self.bars.close] if self.bars else []) + [self.logs.close,
                                                                  self.events.close,
                                                                  self._end_quiet]:
            try:
                close()
            except Exception:  # noqa: BLE001 - the fit's own outcome matters more
                log.warning("could not close a run record file", exc_info=True)
