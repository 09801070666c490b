"""Wait for an observable condition, with a deadline, instead of sleeping a guessed time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float = 10.0, what: str = "") -> T:
    """Return ``condition()``'s first truthy value, checking it every 5 ms.

    Raises:
        AssertionError: ``timeout`` seconds passed first; the message names ``what``.
    """
    deadline = time.monotonic() + timeout
    pause = threading.Event()  # never set: an interruptible 5 ms pause between checks
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout} s: {what or condition}")
        pause.wait(0.005)
