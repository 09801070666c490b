"""The launcher's heartbeat monitor, shared by the fixed-size launchers and the elastic driver."""

from __future__ import annotations

from hvd_spark.runner.heartbeat_monitor import HeartbeatMonitor
from tests.waiting import wait_until


def test_a_silent_rank_is_reported_once_and_beats_answer_the_abort_reason():
    silent: list[tuple[object, float]] = []
    checks: list[None] = []
    monitor = HeartbeatMonitor(0.3, lambda w, s: silent.append((w, s)),
                               lambda found: checks.append(None))
    try:
        assert monitor.beat("0", 0) is None and monitor.beat("1", 0) is None
        monitor.forget(1)
        wait_until(lambda: silent, what="rank 0 reported silent")
        # Later checks (the monitor reports each check's end) must not report it again.
        seen = len(checks)
        wait_until(lambda: len(checks) >= seen + 3, what="three more checks")
        assert [w for w, _ in silent] == [0] and silent[0][1] > 0.3
        monitor.abort("rank 0 froze")
        monitor.abort("a later reason")
        assert monitor.beat("1", 0) == "rank 0 froze"
    finally:
        monitor.close()


def test_touch_watches_any_worker_id_and_each_check_ends_with_on_checked():
    silent: list[object] = []
    checks: list[None] = []
    monitor = HeartbeatMonitor(0.3, lambda w, s: silent.append(w),
                               lambda found: checks.append(None))
    try:
        monitor.touch("2.0")
        wait_until(lambda: checks, timeout=2, what="a check")
        wait_until(lambda: silent == ["2.0"], timeout=3, what="2.0 reported silent")
    finally:
        monitor.close()


def test_a_limit_of_zero_watches_nothing_but_still_checks():
    silent: list[object] = []
    checks: list[None] = []
    monitor = HeartbeatMonitor(0, lambda w, s: silent.append(w),
                               lambda found: checks.append(None))
    try:
        monitor.touch("a")
        wait_until(lambda: len(checks) >= 3, timeout=3, what="three checks")
        assert silent == []
    finally:
        monitor.close()
