"""Launcher side of the workers' heartbeat: notice a silent worker.

A rank whose process froze or whose host was cut off sends no TCP reset, so its peers
would wait for the collective timeout. Ranks beat to the launcher's store (see
``hvd_spark.collectives.heartbeat``); this monitor calls ``on_silent`` for a worker that
fell silent. Fixed-size launchers serve :meth:`HeartbeatMonitor.beat`, which answers the
other ranks' beats with the abort reason and so ends their collectives at once; the
elastic driver records beats with :meth:`HeartbeatMonitor.touch` and answers them itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable

BEAT = "beat"
_CHECK_PERIOD_S = 0.25


def hearing_grace(limit: float) -> float:
    """Seconds a launcher that found a rank silent waits before stopping the others.

    It answers their next beat (every quarter of ``limit``) with the reason; they fail
    their collectives with it and report it, so that every survivor's error names the
    silent rank, not "rank 0 disconnected" after rank 0 was stopped first. One beat,
    plus a second to fail, report and exit.
    """
    return limit / 4 + 1.0


class HeartbeatMonitor:
    """Tracks the last beat of each worker, in a thread that checks every 0.25 s.

    Workers are keyed by any hashable id: ranks (``int``) in fixed-size jobs, worker
    ids (``str``) in elastic ones.

    Args:
        limit: Seconds of silence after which a worker counts as lost (<= 0: never).
        on_silent: Called once per silent worker with ``(worker, seconds silent)``; the
            worker is no longer watched until its next beat.
        on_checked: Called after each check with that check's silent workers (the elastic
            driver acts on them together, and on its deadlines, every check).
    """

    def __init__(self, limit: float,
                 on_silent: Callable[[Hashable, float], None] | None = None,
                 on_checked: Callable[[list[tuple[Hashable, float]]], None] | None = None,
                 ) -> None:
        self.limit = limit
        self._on_silent = on_silent
        self._on_checked = on_checked
        self._lock = threading.Lock()
        self._last: dict[Hashable, float] = {}
        self.abort_reason: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hvd-heartbeats", daemon=True)
        self._thread.start()

    def beat(self, worker: str, generation: int) -> str | None:
        """Store handler of fixed-size jobs: record rank ``worker``'s beat.

        Returns:
            Why the job is breaking up (the rank aborts its collectives), or None.
        """
        del generation  # fixed-size jobs have one ring
        with self._lock:
            self._last[int(worker)] = time.monotonic()
            return self.abort_reason

    def touch(self, worker: Hashable) -> None:
        """Record a beat of ``worker`` now (also: start or restart its clock)."""
        with self._lock:
            self._last[worker] = time.monotonic()

    def forget(self, worker: Hashable) -> None:
        """Stop watching ``worker`` (its process ended, or it was declared lost)."""
        with self._lock:
            self._last.pop(worker, None)

    def abort(self, reason: str) -> None:
        """Tell every rank at its next beat that the job is breaking up."""
        with self._lock:
            if self.abort_reason is None:
                self.abort_reason = reason

    def _loop(self) -> None:
        while not self._stop.wait(_CHECK_PERIOD_S):
            silent = self._take_silent()
            if self._on_silent is not None:
                for worker, seconds in silent:
                    self._on_silent(worker, seconds)
            if self._on_checked is not None:
                self._on_checked(silent)

    def _take_silent(self) -> list[tuple[Hashable, float]]:
        """The workers silent for over ``limit`` s, sorted, no longer watched."""
        if self.limit <= 0:
            return []
        now = time.monotonic()
        with self._lock:
            silent = {w: now - t for w, t in self._last.items() if now - t > self.limit}
            for worker in silent:
                del self._last[worker]
        return sorted(silent.items())

    def close(self) -> None:
        """Stop watching (waits up to 2 s for a check in progress)."""
        self._stop.set()
        self._thread.join(2.0)
