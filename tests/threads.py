"""Run one callable per simulated rank on its own thread (for in-process tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any


def run_on_threads(items: Sequence[Any], fn: Callable[[Any], Any], timeout: float = 120) -> list:
    """Return ``[fn(item) for item in items]`` computed concurrently; re-raise the first error."""
    results: list = [None] * len(items)
    errors: list = []

    def body(i: int) -> None:
        try:
            results[i] = fn(items[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), f"a thread was still running after {timeout} s"
    return results
