"""The Chrome-trace timeline: known call sequences give the expected, well-formed events."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from hvd_spark.collectives import timeline as tl
from hvd_spark.errors import ConfigError
from tests import timeline_events as te
from tests.waiting import wait_until


def test_known_sequence_gives_horovods_rows_and_phases(tmp_path):
    path = tmp_path / "timeline.json"
    with tl.Timeline(str(path), mark_cycles=True) as t:
        t.mark_cycle()
        t.negotiate_start("grad.a", "allreduce")
        t.negotiate_rank_ready("grad.a", 0)
        t.negotiate_start("grad.b", "allreduce")
        t.negotiate_rank_ready("grad.a", 1)
        t.negotiate_end("grad.a")
        t.negotiate_end("grad.b")
        t.mark_cycle()
        t.start_all(["grad.a", "grad.b"], "allreduce", {"bytes": 24})
        t.activity_start_all(["grad.a", "grad.b"], tl.QUEUE)
        t.activity_start_all(["grad.a", "grad.b"], tl.MEMCPY_IN_FUSION_BUFFER)
        t.activity_start_all(["grad.a", "grad.b"], tl.RING_ALLREDUCE)
        t.activity_start_all(["grad.a", "grad.b"], tl.MEMCPY_OUT_FUSION_BUFFER)
        t.end("grad.a", {"dtype": "float32", "shape": [3]})
        t.end("grad.b")
        t.negotiate_start("obj", "broadcast")
        t.negotiate_end("obj")
        t.start("obj", "broadcast")
        t.end("obj")
    events = te.load(path)
    te.assert_well_formed(events)

    header = [e for e in events if e["pid"] == 0 and e["ph"] == "M"]
    assert "start_time_since_epoch_in_micros" in header[0]["args"]
    assert abs(header[0]["args"]["start_time_since_epoch_in_micros"] / 1e6 - time.time()) < 60
    rows = te.rows(events)
    assert rows == {"grad.a": 1, "grad.b": 2, "obj": 3}
    sort = {e["pid"]: e["args"]["sort_index"] for e in events
            if e.get("name") == "process_sort_index"}
    assert sort == {0: 0, 1: 1, 2: 2, 3: 3}

    op = [("B", "ALLREDUCE"),
          ("B", "QUEUE"), ("E", None), ("B", "MEMCPY_IN_FUSION_BUFFER"), ("E", None),
          ("B", "RING_ALLREDUCE"), ("E", None), ("B", "MEMCPY_OUT_FUSION_BUFFER"), ("E", None),
          ("E", None)]
    assert te.phases(events, 1) == [("B", "NEGOTIATE_ALLREDUCE"), ("X", "0"), ("X", "1"),
                                  ("E", None), *op]
    assert te.phases(events, 2) == [("B", "NEGOTIATE_ALLREDUCE"), ("E", None), *op]
    assert te.phases(events, 3) == [("B", "NEGOTIATE_BROADCAST"), ("E", None),
                                  ("B", "BROADCAST"), ("E", None)]

    ends = [e for e in events if e["pid"] == 1 and e["ph"] == "E"]
    assert ends[-1]["args"] == {"dtype": "float32", "shape": [3]}
    starts = [e for e in events if e["pid"] == 1 and e.get("name") == "ALLREDUCE"]
    assert starts[0]["args"] == {"bytes": 24}
    cycles = [e for e in events if e["ph"] == "i"]
    assert [c["name"] for c in cycles] == ["CYCLE_START", "CYCLE_START"]
    assert all(c["s"] == "g" for c in cycles)


def test_names_with_quotes_and_unicode_are_escaped(tmp_path):
    path = tmp_path / "t.json"
    name = 'layer"1\\w\u00e9\n'
    with tl.Timeline(str(path)) as t:
        t.negotiate_start(name, "allgather")
        t.negotiate_end(name)
    events = te.load(path)
    assert te.rows(events) == {name: 1}
    assert te.phases(events, 1) == [("B", "NEGOTIATE_ALLGATHER"), ("E", None)]


def test_cycles_not_marked_unless_asked(tmp_path):
    path = tmp_path / "t.json"
    with tl.Timeline(str(path), mark_cycles=False) as t:
        t.mark_cycle()
        t.negotiate_start("x", "allreduce")
    events = te.load(path)
    assert not [e for e in events if e["ph"] == "i"]
    assert te.phases(events, 1) == [("B", "NEGOTIATE_ALLREDUCE"), ("E", None)]  # ended at close


def test_out_of_order_reports_still_pair(tmp_path):
    path = tmp_path / "t.json"
    with tl.Timeline(str(path)) as t:
        t.activity_start("a", tl.QUEUE)        # no operation open: nothing
        t.activity_end("a")
        t.end("a")
        t.negotiate_end("a")
        t.negotiate_start("a", "allreduce")
        t.negotiate_start("a", "allreduce")    # already negotiating: nothing
        t.start("a", "allreduce")              # ends the negotiation first
        t.activity_start("a", tl.QUEUE)
        t.negotiate_start("a", "allreduce")    # name reused while in flight: ends the op
        t.negotiate_end("a")
        t.start("b", "allgather")
        t.activity_start("b", tl.QUEUE)
        t.activity_end("b")
        t.activity_end("b")                    # no activity open: nothing
    events = te.load(path)
    te.assert_well_formed(events)
    rows = te.rows(events)
    assert te.phases(events, rows["a"]) == [
        ("B", "NEGOTIATE_ALLREDUCE"), ("E", None), ("B", "ALLREDUCE"), ("B", "QUEUE"),
        ("E", None), ("E", None), ("B", "NEGOTIATE_ALLREDUCE"), ("E", None)]
    # "b" was still open at close(): ended there.
    assert te.phases(events, rows["b"]) == [("B", "ALLGATHER"), ("B", "QUEUE"), ("E", None),
                                          ("E", None)]


def test_file_is_valid_json_while_recording(tmp_path):
    path = tmp_path / "t.json"
    t = tl.Timeline(str(path), flush_interval_s=0.01)
    try:
        t.negotiate_start("a", "allreduce")
        t.negotiate_end("a")
        # The writer thread flushes on its own; every look at the file must parse.
        phases = wait_until(lambda: path.stat().st_size and te.phases(te.load(path), 1),
                            what="the first write")
        assert phases == [("B", "NEGOTIATE_ALLREDUCE"), ("E", None)]
        t.start("a", "allreduce")
        t.end("a")
        wait_until(lambda: len(te.phases(te.load(path), 1)) == 4, what="the second write")
    finally:
        t.close()
    assert len(te.phases(te.load(path), 1)) == 4
    assert t.closed
    t.start("a", "allreduce")  # after close: ignored, no error
    t.close()


def test_empty_timeline_is_valid_json(tmp_path):
    path = tmp_path / "t.json"
    tl.Timeline(str(path)).close()
    events = te.load(path)
    assert [e["name"] for e in events] == ["process_name", "process_sort_index"]


def test_threads_recording_at_once(tmp_path):
    path = tmp_path / "t.json"
    threads_n, ops = 8, 500

    def work(t, k):
        for i in range(ops):
            name = f"t{k}.{i % 10}"
            t.negotiate_start(name, "allreduce")
            t.negotiate_end(name)
            t.start(name, "allreduce")
            t.activity_start(name, tl.QUEUE)
            t.activity_start(name, tl.RING_ALLREDUCE)
            t.end(name)
            t.mark_cycle()

    with tl.Timeline(str(path), mark_cycles=True, flush_interval_s=0.005) as t:
        threads = [threading.Thread(target=work, args=(t, k)) for k in range(threads_n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
    events = te.load(path)
    te.assert_well_formed(events)
    assert len(te.rows(events)) == threads_n * 10
    assert sum(e["ph"] == "B" for e in events) == threads_n * ops * 4
    assert sum(e["ph"] == "i" for e in events) == threads_n * ops


def test_module_start_and_stop(tmp_path):
    first, second = tmp_path / "1.json", tmp_path / "2.json"
    assert tl.current() is None
    t1 = tl.start_timeline(str(first), mark_cycles=True)
    assert tl.current() is t1
    t1.negotiate_start("a", "allreduce")
    assert tl.start_timeline(str(first), mark_cycles=False) is t1  # same file: just the flag
    assert t1.mark_cycles is False
    t2 = tl.start_timeline(str(second))
    assert t1.closed and tl.current() is t2
    t2.start("b", "broadcast")
    tl.stop_timeline()
    assert tl.current() is None and t2.closed
    tl.stop_timeline()  # stopping twice is fine
    assert te.rows(te.load(first)) == {"a": 1}
    assert te.phases(te.load(second), 1) == [("B", "BROADCAST"), ("E", None)]


@pytest.mark.parametrize("bad", ["", None])
def test_empty_path_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="file_path"):
        tl.Timeline(bad)


def test_unwritable_path_names_it(tmp_path):
    missing = tmp_path / "no" / "such" / "dir" / "t.json"
    with pytest.raises(ConfigError, match="no/such/dir"):
        tl.start_timeline(str(missing))
    assert tl.current() is None


def test_events_written_at_process_exit_without_close(tmp_path):
    path = tmp_path / "t.json"
    code = (
        "from hvd_spark.collectives import timeline as tl\n"
        f"t = tl.start_timeline({str(path)!r}, mark_cycles=True)\n"
        "for i in range(1000):\n"
        "    t.negotiate_start(f'g{i}', 'allreduce'); t.negotiate_end(f'g{i}')\n"
        "    t.start(f'g{i}', 'allreduce'); t.mark_cycle()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    events = te.load(path)
    te.assert_well_formed(events)
    assert len(te.rows(events)) == 1000
    assert sum(e["ph"] == "E" for e in events) == 2000  # the open ops ended at exit


def test_recording_cost_per_call(tmp_path):
    """Each call costs a few microseconds on the caller's thread (figures in the output)."""
    names = [f"layer{i}.weight" for i in range(50)]
    steps = 200
    with tl.Timeline(str(tmp_path / "t.json"), mark_cycles=True) as t:
        begin = time.perf_counter()
        for _ in range(steps):
            t.mark_cycle()
            for name in names:
                t.negotiate_start(name, "allreduce")
            for name in names:
                t.negotiate_end(name)
            t.start_all(names, "allreduce")
            t.activity_start_all(names, tl.QUEUE)
            t.activity_start_all(names, tl.MEMCPY_IN_FUSION_BUFFER)
            t.activity_start_all(names, tl.RING_ALLREDUCE)
            t.activity_start_all(names, tl.MEMCPY_OUT_FUSION_BUFFER)
            t.end_all(names)
        recorded = time.perf_counter() - begin
    per_tensor_us = recorded / (steps * len(names)) * 1e6
    print(f"timeline: {per_tensor_us:.2f} us per tensor per step on the caller's thread "
          f"(12 events each, fused calls)")
    # The cost is a figure to read, not an assertion (timings on a shared machine vary);
    # what must hold is that every event of every step reached the file.
    events = te.load(tmp_path / "t.json")
    starts = [e for e in events if e["ph"] == "B" and e.get("name") == "ALLREDUCE"]
    assert len(starts) == steps * len(names)
    te.assert_well_formed(events)
