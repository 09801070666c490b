"""One Spark job run in a background thread under its own job group, so it can be cancelled.

``hvd_spark.run``'s barrier job and ``run_elastic``'s job of worker tasks both run this way:
the calling thread supervises the ranks while the job's ``collect`` blocks in this one,
and cancels the job the moment the run is over or failed. A classic session marks the
job with a job group; Spark Connect has none, so a tag (thread-local on the client) does.
pyspark is imported inside functions so importing this module never needs it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("hvd_spark.runner")

#: Seconds to wait for the job's thread to end once the job was cancelled.
JOIN_TIMEOUT_S = 30.0


class JobThread:
    """Runs ``build().collect()`` in a thread; ``on_done(error)`` hears how it ended.

    Args:
        spark: The session (classic or Spark Connect).
        group: The job group (a tag on Connect) that marks the job for cancelling.
        description: What the Spark UI shows for the job group.
        build: Returns the DataFrame (or RDD) whose ``collect`` is the job; called in the
            thread, inside the job group.
        on_done: Called in the thread with the job's exception, or None when it ended.
    """

    def __init__(self, spark: Any, group: str, description: str, build: Callable[[], Any],
                 on_done: Callable[[BaseException | None], None]) -> None:
        from hvd_spark.runner.spark.connect import is_connect

        self.spark = spark
        self.group = group
        self.remote = is_connect(spark)
        self._description = description
        self._build = build
        self._on_done = on_done
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Submit the job in the background."""
        from pyspark import InheritableThread

        self._thread = InheritableThread(target=self._collect, name=f"hvd-job-{self.group}",
                                         daemon=True, session=self.spark)
        self._thread.start()

    def _collect(self) -> None:
        if self.remote:
            self.spark.addTag(self.group)
        else:
            self.spark.sparkContext.setJobGroup(self.group, self._description,
                                                interruptOnCancel=True)
        error: BaseException | None = None
        try:
            self._build().collect()
        except BaseException as exc:  # noqa: BLE001 - handed to the supervising thread
            error = exc
        finally:
            if self.remote:
                self.spark.removeTag(self.group)
        self._on_done(error)

    @property
    def running(self) -> bool:
        """Whether the job's thread is still running."""
        return self._thread is not None and self._thread.is_alive()

    def cancel(self) -> None:
        """Cancel the job (its tasks are interrupted); nothing when it has ended."""
        if not self.running:
            return
        log.info("cancelling Spark job group %s", self.group)
        if self.remote:
            self.spark.interruptTag(self.group)
        else:
            self.spark.sparkContext.cancelJobGroup(self.group)

    def join(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Wait (bounded) for the job's thread to end; log when it did not."""
        if self._thread is None:
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the Spark job of group %s did not end within %s s after the run",
                        self.group, timeout_s)
