"""What a user sees on the driver without configuring anything."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator


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
    if verbose < 1 or logger.handlers or logging.getLogger().handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Prefixed())
    handler.setLevel(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
