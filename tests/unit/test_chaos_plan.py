"""The chaos soak's pure logic: the seeded plan of faults and each fault's row."""

from __future__ import annotations

import random

from hvd_spark.bench.chaos import faults, injector, report
from hvd_spark.bench.chaos.events import Event, Events, LineTap


def test_the_plan_is_a_function_of_the_seed_and_never_starts_in_recovery():
    kinds = list(faults.KINDS)
    one = injector.plan(random.Random(5), 30, kinds, (10, 20))
    assert one == injector.plan(random.Random(5), 30, kinds, (10, 20))
    assert one != injector.plan(random.Random(6), 30, kinds, (10, 20))
    assert not one[0].in_recovery
    assert any(p.in_recovery for p in one)  # 30 draws from 7 choices
    for p in one:
        assert p.kind in kinds
        assert (p.gap == 0 and 0 <= p.delay <= 2) if p.in_recovery else 10 <= p.gap <= 20
    assert not any(p.in_recovery for p in injector.plan(random.Random(5), 30, kinds, (1, 2),
                                                        in_recovery=False))


def _steps(events: Events, start: float, end: float, first: int, every: float = 0.2) -> None:
    for k in range(round((end - start) / every)):
        events.add(Event(start + k * every, "step", first + k))


def test_a_detected_fault_counts_the_steps_done_again():
    events = Events()
    _steps(events, 0.0, 10.0, 1)  # steps 1..50, the last at 9.8
    kill = faults.Injected("rank-kill", "hvdhost2 pid 1", 10.0)
    events.add(Event(10.5, "detected", text="cancelling Spark job group x"))
    _steps(events, 30.0, 32.0, 46)  # resumed from the checkpoint after step 45
    row, = report.rows(events, [kill], started=0.0)
    assert row.at == 10.0 and row.detected == 0.5 and row.went_on == 20.0
    assert row.lost == 50 - 45 and row.ended is None


def test_a_stall_that_nothing_detected_ends_with_the_fault():
    events = Events()
    _steps(events, 0.0, 10.2, 1)  # the step at 10.0 was on the wire as the link went down
    down = faults.Injected("link-down", "hvdhost3", 9.95, duration=5.0)
    _steps(events, 16.0, 17.0, 52)
    row, = report.rows(events, [down], started=0.0)
    assert row.detected is None and row.went_on == 16.0 - 9.95 and row.lost == 0
    assert "absorbed, went on" in report.table([row])[2]


def test_a_sign_as_the_run_ends_is_not_the_detection_of_an_absorbed_fault():
    events = Events()
    _steps(events, 0.0, 10.0, 1)
    down = faults.Injected("link-down", "hvdhost3", 9.9, duration=5.0)
    _steps(events, 15.0, 40.0, 51)  # training went on after the link came back
    events.add(Event(80.0, "reset", text="generation 4 ... left generation 3 to re-form"))
    row, = report.rows(events, [down], started=0.0)
    assert row.detected is None and row.went_on is not None and row.lost == 0
    # A stall that lasted until that sign is still a detection with nothing after it.
    stalled = Events()
    _steps(stalled, 0.0, 10.0, 1)
    stalled.add(Event(80.0, "reset"))
    row, = report.rows(stalled, [down], started=0.0)
    assert row.detected is not None and row.went_on is None


def test_a_fault_that_ends_its_job_names_the_error_and_loses_the_job():
    events = Events()
    _steps(events, 0.0, 4.0, 1)  # a DDP job's steps 1..20
    kill = faults.Injected("executor-kill", "hvdhost1 pid 7", 4.0)
    events.add(Event(4.2, "detected"))
    events.add(Event(4.5, "ended", text="rank 1 on hvdhost2: executor 2 lost"))
    _steps(events, 20.0, 21.0, 1)  # the next job
    row, = report.rows(events, [kill], started=0.0)
    assert abs(row.detected - 0.2) < 1e-9
    assert row.went_on is None and row.lost == 20
    assert "job ended: rank 1 on hvdhost2: executor 2 lost" in report.table([row])[2]


def test_a_driver_line_about_a_lost_rank_is_a_detection():
    events = Events()
    out = LineTap(events)
    out.write("hvd_spark.run_elastic: generation 1: 3 ranks on 3 host(s)\n[0] step 3\n")
    out.write("hvd_spark.run_elastic: rank 2 (worker 0.0, Spark executor 1 (pid 7) on "
              "hvdhost2) lost: exited with code -9\n")
    out.write("hvd_spark.run_elastic: generation 2: 2 ranks on 2 host(s) after: rank 2 ...\n")
    # A generation's start is no failure; a lost rank and a re-formed ring are.
    assert [e.text[:40] for e in events.since(0.0)] == [
        "hvd_spark.run_elastic: rank 2 (worker 0.", "hvd_spark.run_elastic: generation 2: 2 r"]
    assert out.lines[1] == "[0] step 3"


def test_bad_options_are_named_before_any_host_is_built(capsys):
    import pytest

    from hvd_spark.bench.chaos import parse_args

    for argv, named in ((["--hosts", "2"], "--hosts"), (["--kinds", "rank-kill,flood"], "flood"),
                        (["--faults", "0"], "--faults")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert named in capsys.readouterr().err
    args = parse_args(["--faults", "4", "--workload", "elastic"])
    assert args.deadline == 240 + 90 * 4 and args.kinds == list(faults.KINDS)
