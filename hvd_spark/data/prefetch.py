"""A bounded background-thread prefetcher with deadlines and error propagation."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

from hvd_spark.errors import DataError

T = TypeVar("T")
_POLL_S = 0.1  # how often a blocked producer looks at the stop flag


class _End:
    pass


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _put(q: queue.Queue, stop: threading.Event, item: object) -> bool:
    # A bounded wait in a loop: the consumer may be busy training for a long time,
    # but a stop request must be seen within _POLL_S.
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterator, q: queue.Queue, stop: threading.Event) -> None:
    try:
        for item in source:
            if not _put(q, stop, item):
                return
        _put(q, stop, _End())
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
        _put(q, stop, _Failure(exc))
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


class Prefetcher(Generic[T]):
    """Runs ``source`` in a daemon thread and hands its items over through a bounded queue.

    The consumer waits at most ``timeout_s`` for each item; an exception raised by the
    source is re-raised in the consumer with its original traceback. Closing the
    prefetcher (or dropping it, or leaving a ``for`` loop early) stops the thread.

    Args:
        source: The iterator to run in the background; it is closed in its own thread.
        max_items: Queue bound: how many items may wait for the consumer.
        timeout_s: Longest wait for one item before ``DataError``.
        name: Thread name and label used in error messages.
    """

    def __init__(self, source: Iterator[T], max_items: int, timeout_s: float, name: str) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, max_items))
        self._stop = threading.Event()
        self._timeout_s = timeout_s
        self._name = name
        self._done = False
        # The thread must not reference self: dropping the prefetcher then stops it (__del__).
        self._thread = threading.Thread(
            target=_produce, args=(source, self._queue, self._stop), name=name, daemon=True
        )
        self._thread.start()

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        try:
            item = self._queue.get(timeout=self._timeout_s)
        except queue.Empty:
            self.close()
            raise DataError(
                f"{self._name}: no batch arrived within {self._timeout_s:.0f} s; the reader "
                "thread is stuck (slow or unreachable storage?). Raise timeout_s if reads "
                "are legitimately this slow"
            ) from None
        if isinstance(item, _End):
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        return item

    def close(self, join_timeout_s: float = 10.0) -> None:
        """Stop the producer thread and wait (bounded) for it to finish."""
        self._done = True
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=join_timeout_s)

    def __del__(self) -> None:
        self._stop.set()
