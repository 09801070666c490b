"""The timeline of a known run on real ranks (run_local), loaded back from its JSON file."""

from __future__ import annotations

import time

from hvd_spark.runner import run_local
from tests import timeline_events as te


def _known_run(steps: int) -> int:
    import numpy as np

    import hvd_spark.collectives as hvd

    hvd.init()
    for _ in range(steps):
        hvd.allreduce(np.arange(3, dtype=np.float32), name="test_allreduce")
    hvd.allgather(np.ones(2), name="gathered")
    hvd.broadcast(np.zeros(4), 0, name="weights")
    hvd.grouped_allreduce([np.ones(3), np.ones(5)], name="group")  # packed: one tensor
    for handle in hvd.allreduce_many_async_([np.ones(3), np.ones(5)], ["fused.0", "fused.1"]):
        hvd.synchronize(handle)  # one batch: one fused operation
    return hvd.rank()


def test_horovod_timeline_variable_records_a_known_run(tmp_path):
    path = tmp_path / "timeline.json"
    # Eager off: these small tensors take the ring and fusion phases checked below.
    env = {"HOROVOD_TIMELINE": str(path), "HOROVOD_TIMELINE_MARK_CYCLES": "1",
           "HVD_SPARK_EAGER_BYTES": "0"}
    assert run_local(_known_run, args=(3,), num_proc=2, env=env) == [0, 1]
    events = te.load(path)
    te.assert_well_formed(events, ordered=False)
    header = next(e for e in events if e["pid"] == 0 and e["ph"] == "M")
    assert abs(header["args"]["start_time_since_epoch_in_micros"] / 1e6 - time.time()) < 600
    rows = te.rows(events)
    assert {"allreduce.test_allreduce", "allgather.gathered", "broadcast.weights"} <= set(rows)
    phases = te.phases(events, rows["allreduce.test_allreduce"])
    begins = [name for ph, name in phases if ph == "B"]
    assert begins.count("NEGOTIATE_ALLREDUCE") == 3 and begins.count("ALLREDUCE") == 3
    assert ("X", "1") in phases  # rank 1's request reached the coordinator
    assert "RING_ALLREDUCE" in begins  # a lone tensor needs no fusion-buffer copies
    # Each allreduce: its negotiation ends before its operation begins.
    first_op = begins.index("ALLREDUCE")
    assert begins[:first_op] == ["NEGOTIATE_ALLREDUCE"]
    gather = [name for ph, name in te.phases(events, rows["allgather.gathered"]) if ph == "B"]
    assert gather[:2] == ["NEGOTIATE_ALLGATHER", "ALLGATHER"]
    assert any(e["ph"] == "i" and e["name"] == "CYCLE_START" for e in events)
    packed = [name for ph, name in te.phases(events, rows["allreduce.group.packed"]) if ph == "B"]
    assert packed[:2] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"] and "RING_ALLREDUCE" in packed
    assert "allreduce.group.0" not in rows  # its small tensors travelled packed
    for member in ("allreduce.fused.0", "allreduce.fused.1"):
        fused = [name for ph, name in te.phases(events, rows[member]) if ph == "B"]
        assert fused[:2] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"]
        assert fused.index("MEMCPY_IN_FUSION_BUFFER") < fused.index("RING_ALLREDUCE") < (
            fused.index("MEMCPY_OUT_FUSION_BUFFER"))


def test_timeline_shows_small_allreduces_reduced_during_negotiation(tmp_path):
    path = tmp_path / "timeline.json"
    assert run_local(_known_run, args=(2,), num_proc=2,
                     env={"HOROVOD_TIMELINE": str(path)}) == [0, 1]
    events = te.load(path)
    te.assert_well_formed(events, ordered=False)
    rows = te.rows(events)
    for row in ("allreduce.test_allreduce", "allreduce.group.packed", "allreduce.fused.0"):
        begins = [name for ph, name in te.phases(events, rows[row]) if ph == "B"]
        assert "EAGER_ALLREDUCE" in begins and "RING_ALLREDUCE" not in begins, begins


def _dynamic(first: str, second: str) -> None:
    import numpy as np

    import hvd_spark.collectives as hvd

    hvd.init()
    hvd.allreduce(np.ones(2), name="before")  # no timeline yet
    hvd.start_timeline(first, mark_cycles=True)
    hvd.allreduce(np.ones(2), name="test_allreduce")
    hvd.start_timeline(second, mark_cycles=False)  # switches files
    hvd.allreduce(np.ones(2), name="second")
    hvd.stop_timeline()
    hvd.allreduce(np.ones(2), name="after")  # recorded nowhere


def test_start_and_stop_timeline_switch_files(tmp_path):
    first, second = tmp_path / "1.json", tmp_path / "2.json"
    run_local(_dynamic, args=(str(first), str(second)), num_proc=2,
              env={"HOROVOD_TIMELINE": "DYNAMIC"})
    one, two = te.load(first), te.load(second)
    te.assert_well_formed(one, ordered=False)
    te.assert_well_formed(two, ordered=False)
    # Rank 1 may submit the next tensor before rank 0 switches files: a row of the next
    # call may start in the earlier file (as in Horovod), never one of an earlier call.
    assert "allreduce.test_allreduce" in te.rows(one)
    assert not {"allreduce.before", "allreduce.after"} & set(te.rows(one))
    assert "allreduce.second" in te.rows(two)
    assert not {"allreduce.before", "allreduce.test_allreduce"} & set(te.rows(two))
    assert not any(e["ph"] == "i" for e in two)
