"""Spark's console stage bar is held off while a fit draws its bars: the holding thread,
and when a fit's RunRecord starts and ends it (Spark itself: tests/integration)."""

from __future__ import annotations

import io
import threading

from hvd_spark.estimator import spark_console
from tests.waiting import wait_until


class FakeBar:
    """Counts ``finishAll()`` calls, as the JVM's ConsoleProgressBar would get them."""

    def __init__(self) -> None:
        self.calls = 0

    def finishAll(self) -> None:  # noqa: N802 - the JVM's name
        self.calls += 1


def _holders() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "hvd-quiet-stage-bar"]


def test_the_bar_is_held_while_the_block_runs_and_released_after():
    # Every call holds Spark's drawing for 500 ms: the holder calls again sooner.
    assert spark_console.INTERVAL_S < 0.5
    bar = FakeBar()
    with spark_console.quiet_stage_bar(bar=bar):
        wait_until(lambda: bar.calls >= 3, what="three finishAll() calls")
        assert _holders() == ["hvd-quiet-stage-bar"]
    # The block's exit joined the holder: nothing calls the bar any more.
    calls = bar.calls
    assert _holders() == [], "released: Spark's bar is back"
    with spark_console.quiet_stage_bar(enabled=False, bar=bar):
        assert _holders() == []
    assert bar.calls == calls


def test_a_fit_holds_it_from_its_first_event_to_its_close(tmp_path, monkeypatch):
    from hvd_spark.data import Store
    from hvd_spark.estimator import run_record
    from hvd_spark.estimator.progress import TrainingProgress

    bar = FakeBar()
    monkeypatch.setattr(spark_console, "console_bar", lambda: bar)
    store = Store.create(str(tmp_path / "store"))
    quiet = run_record.RunRecord(store, "r", 1, verbose=0)
    quiet.progress(0, {"kind": "epoch", "epoch": 1, "epochs": 1, "metrics": {}})
    assert bar.calls == 0 and _holders() == [], "no bars of ours: Spark's stays"
    quiet.close()
    record = run_record.RunRecord(store, "r", 1, verbose=1)
    record.bars = TrainingProgress(1, file=io.StringIO())
    assert bar.calls == 0, "not before the ranks report: no bar of ours is drawn yet"
    record.progress(0, {"kind": "step", "epoch": 1, "step": 1, "steps": 2, "loss": 0.5,
                        "samples": 8, "elapsed": 0.1})
    assert bar.calls >= 1 and _holders() == ["hvd-quiet-stage-bar"]
    record.close()
    assert _holders() == []
