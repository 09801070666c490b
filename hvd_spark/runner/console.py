"""What a user sees on the driver without configuring anything."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

# The handler verbose_logging added (shared by concurrent fits) and how many use it.
_SHOWING: dict[str, Any] = {"handler": None, "level": logging.NOTSET, "users": 0}
_SHOWING_LOCK = threading.Lock()


class _Prefixed(logging.Formatter):
    """``hvd_spark: message``, unless the message already starts with the name."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if text.startswith("hvd_spark") else f"hvd_spark: {text}"


@contextlib.contextmanager
def verbose_logging(verbose: int) -> Iterator[None]:
    """Show hvd_spark's INFO messages on stderr while the block runs, when ``verbose >= 1``
    and the application has not configured logging itself (no handler anywhere).

    Python drops INFO records by default, so "reusing dataset", "resuming from epoch 4"
    or the rank assignment would otherwise be invisible in a notebook.
    """
    logger = logging.getLogger("hvd_spark")
    with _SHOWING_LOCK:
        # Concurrent fits (CrossValidator(parallelism=n)) share one handler: the last
        # to finish removes it, so no fit's messages vanish when another ends.
        shared = _SHOWING["handler"] is not None
        configured = logger.handlers or logging.getLogger().handlers
        ours = verbose >= 1 and (shared or not configured)
        if ours and not shared:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(_Prefixed())
            handler.setLevel(logging.INFO)
            _SHOWING.update(handler=handler, level=logger.level)
            logger.addHandler(handler)
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)
        if ours:
            _SHOWING["users"] += 1
    try:
        yield
    finally:
        if ours:
            with _SHOWING_LOCK:
                _SHOWING["users"] -= 1
                if _SHOWING["users"] == 0:
                    logger.removeHandler(_SHOWING["handler"])
                    logger.setLevel(_SHOWING["level"])
                    _SHOWING.update(handler=None, level=logging.NOTSET)
