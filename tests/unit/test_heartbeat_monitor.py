"""The launcher's heartbeat monitor, shared by the fixed-size launchers and the elastic driver."""

from __future__ import annotations

import threading
import time

from hvd_spark.runner.heartbeat_monitor import HeartbeatMonitor


def _wait_for(condition, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_silent_rank_is_reported_once_and_beats_answer_the_abort_reason():
    silent: list[tuple[object, float]] = []
    monitor = HeartbeatMonitor(0.3, lambda w, s: silent.append((w, s)))
    try:
        assert monitor.beat("0", 0) is None and monitor.beat("1", 0) is None
        monitor.forget(1)
        assert _wait_for(lambda: silent)
        time.sleep(0.6)
        assert [w for w, _ in silent] == [0] and silent[0][1] > 0.3
        monitor.abort("rank 0 froze")
        monitor.abort("a later reason")
        assert monitor.beat("1", 0) == "rank 0 froze"
    finally:
        monitor.close()


def test_touch_watches_any_worker_id_and_each_check_ends_with_on_checked():
    silent: list[object] = []
    checks = threading.Event()
    monitor = HeartbeatMonitor(0.3, lambda w, s: silent.append(w), lambda found: checks.set())
    try:
        monitor.touch("2.0")
        assert checks.wait(2)
        assert _wait_for(lambda: silent == ["2.0"])
    finally:
        monitor.close()


def test_a_limit_of_zero_watches_nothing_but_still_checks():
    silent: list[object] = []
    checks: list[None] = []
    monitor = HeartbeatMonitor(0, lambda w, s: silent.append(w),
                               lambda found: checks.append(None))
    try:
        monitor.touch("a")
        assert _wait_for(lambda: len(checks) >= 3)
        assert silent == []
    finally:
        monitor.close()
