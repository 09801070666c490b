"""Launcher side of the ranks' heartbeat in fixed-size jobs: notice a silent rank.

A rank whose process froze or whose host was cut off sends no TCP reset, so its peers
would wait for the collective timeout. Ranks beat to the launcher's store (see
``hvd_spark.collectives.heartbeat``); this monitor calls ``on_silent`` for a rank that
fell silent, and answers the other ranks' beats with the reason, which aborts their
collectives at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

BEAT = "beat"
_CHECK_PERIOD_S = 0.25


class HeartbeatMonitor:
    """Tracks the last beat of each rank.

    Args:
        limit: Seconds of silence after which a rank counts as lost.
        on_silent: Called once per silent rank with ``(rank, seconds silent)``.
    """

    def __init__(self, limit: float, on_silent: Callable[[int, float], None]) -> None:
        self.limit = limit
        self._on_silent = on_silent
        self._lock = threading.Lock()
        self._last: dict[int, float] = {}
        self._silent: dict[int, float] = {}
        self.abort_reason: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hvd-heartbeats", daemon=True)
        self._thread.start()

    def beat(self, worker: str, generation: int) -> str | None:
        """Store handler: record a beat; return why the job is breaking up, if it is."""
        del generation  # fixed-size jobs have one ring
        with self._lock:
            self._last[int(worker)] = time.monotonic()
            return self.abort_reason

    def forget(self, rank: int) -> None:
        """Stop watching ``rank`` (its process ended)."""
        with self._lock:
            self._last.pop(rank, None)

    def abort(self, reason: str) -> None:
        """Tell every rank at its next beat that the job is breaking up."""
        with self._lock:
            if self.abort_reason is None:
                self.abort_reason = reason

    def _loop(self) -> None:
        while not self._stop.wait(_CHECK_PERIOD_S):
            now = time.monotonic()
            with self._lock:
                silent = {r: now - t for r, t in self._last.items() if now - t > self.limit}
                for rank in silent:
                    del self._last[rank]
            for rank, seconds in sorted(silent.items()):
                self._on_silent(rank, seconds)

    def close(self) -> None:
        """Stop watching."""
        self._stop.set()
        self._thread.join(2.0)
