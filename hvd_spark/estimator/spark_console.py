"""Keep Spark's console stage bar off the terminal while the Estimators draw their own bars.

Spark's ``ConsoleProgressBar`` (``spark.ui.showConsoleProgress``, on by default in a
PySpark shell, a notebook or any ``SparkSession.builder`` script) redraws
``[Stage 3:>  (0 + 2) / 2]`` on stderr every 200 ms while a stage of more than one task
runs, for as long as it runs. The barrier stage of a fit runs for the whole training, so
that line lands in the middle of the per-epoch bars. The setting is read once, when the
SparkContext starts: no runtime configuration or local property turns it off.

What does work at run time is the bar's own ``finishAll()``, which Spark calls after every
job: it clears the line and holds the next drawing for 500 ms (``firstDelayMSec``).
``quiet_stage_bar`` calls it every ``INTERVAL_S`` (less than those 500 ms) from a daemon
thread while the training job runs, then stops, so Spark's bar is back for the next
job. Through Spark Connect, or without a JVM bar, it does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

#: Seconds between two ``finishAll()`` calls: under the bar's fixed 500 ms hold.
INTERVAL_S = 0.25


def console_bar() -> Any:
    """The running SparkContext's ``ConsoleProgressBar`` (a py4j object), or None when
    there is none (the setting off, Spark Connect, no SparkContext)."""
    try:
        from pyspark import SparkContext

        sc = SparkContext._active_spark_context
        if sc is None or getattr(sc, "_jsc", None) is None:
            return None
        option = sc._jsc.sc().progressBar()  # private[spark] in Scala, public to py4j
        return option.get() if option.isDefined() else None
    except Exception:  # noqa: BLE001 - a Spark without this API: leave its bar alone
        log.debug("no Spark console progress bar to quiet", exc_info=True)
        return None


@contextlib.contextmanager
def quiet_stage_bar(enabled: bool = True, bar: Any = None) -> Iterator[None]:
    """Hold Spark's console stage bar off while the ``with`` block runs.

    Args:
        enabled: False does nothing (e.g. when no bars of ours are drawn).
        bar: The bar to hold (default: ``console_bar()``); tests give a stand-in.
    """
    bar = (bar or console_bar()) if enabled else None
    if bar is None:
        yield
        return
    stop = threading.Event()

    def hold() -> None:
        while True:
            try:
                bar.finishAll()
            except Exception:  # noqa: BLE001 - the JVM went away: nothing left to hold
                return
            if stop.wait(INTERVAL_S):
                return

    thread = threading.Thread(target=hold, name="hvd-quiet-stage-bar", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        # Bounded: a JVM call stuck in py4j must not hold the fit's result (daemon thread).
        thread.join(timeout=5.0)
