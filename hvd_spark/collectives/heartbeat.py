"""A rank's heartbeat to its launcher, and the abort it may bring back.

A peer that vanishes without a TCP reset (a frozen process, a host cut off) would
otherwise hold every collective for the full collective timeout. Each rank beats to the
launcher's store on its own connection; the launcher declares a silent rank lost and
answers the survivors' next beats with the reason, and the beating thread then aborts the
engine, so blocked collectives fail at once with that reason. A rank that cannot reach
the launcher for the heartbeat interval aborts itself the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hvd_spark.collectives.tcp.store import StoreClient, UnknownRequestError
from hvd_spark.errors import HvdSparkError

log = logging.getLogger(__name__)

BEAT = "beat"
DEFAULT_HEARTBEAT_S = 10.0


class Heartbeat:
    """Beats ``(worker, generation)`` every ``interval / 4`` s in a daemon thread.

    Args:
        addr: The launcher store's ``(host, port)``.
        secret: The job secret.
        worker: This worker's id as the launcher knows it.
        interval: Seconds of silence after which the launcher declares a worker lost.
        on_abort: Called with the reason when the launcher says this rank's generation
            is broken, or when the launcher cannot be reached for ``interval`` s.
    """

    def __init__(
        self,
        addr: tuple[str, int],
        secret: bytes,
        worker: str,
        interval: float,
        on_abort: Callable[[int, str], None],
    ) -> None:
        self._addr, self._secret = addr, secret
        self._client: StoreClient | None = StoreClient(addr, secret, interval)
        self._worker = worker
        self._interval = interval
        self._on_abort = on_abort
        self._generation = 0
        self._aborted_generation = -1
        self._stop = threading.Event()
        # The first beat goes before init() returns: from then on the launcher watches
        # this rank, even if it freezes before the thread's first period ends.
        try:
            self._client.call(BEAT, worker, 0, timeout=interval)
        except UnknownRequestError:
            self._drop_client()
            self._stop.set()
        self._thread = threading.Thread(target=self._loop, name="hvd-heartbeat", daemon=True)
        self._thread.start()

    def set_generation(self, generation: int) -> None:
        """Beat for ``generation`` from now on (the ring this rank belongs to)."""
        self._generation = generation

    def _loop(self) -> None:
        last_ok = time.monotonic()
        period = self._interval / 4
        while not self._stop.wait(period):
            generation = self._generation
            try:
                if self._client is None:
                    self._client = StoreClient(self._addr, self._secret, period)
                reason = self._client.call(BEAT, self._worker, generation, timeout=period)
                last_ok = time.monotonic()
            except UnknownRequestError:
                log.debug("the launcher takes no heartbeats; not beating")
                self._drop_client()
                return
            except (HvdSparkError, OSError) as exc:
                if self._stop.is_set():
                    return
                self._drop_client()  # a timed-out call leaves the stream mid-frame
                silent = time.monotonic() - last_ok
                if silent < self._interval:
                    continue
                reason = (f"the launcher could not be reached for {silent:.0f} s ({exc}); this "
                          "host may be cut off from the job")
            if reason and generation != self._aborted_generation:
                self._aborted_generation = generation
                log.warning("aborting the collectives of generation %d: %s", generation, reason)
                self._on_abort(generation, reason)

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def stop(self) -> None:
        """End the thread and close its connection."""
        self._stop.set()
        client = self._client
        if client is not None:
            client.close()  # wakes a call in flight; the thread then sees the stop flag
        self._thread.join(5.0)
