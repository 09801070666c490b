"""Horovod behaviour on real ranks: aligned names after errors, join, process sets, Adasum,
threads, the timeline, and the launchers' Horovod environment."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_spark.collectives import adasum as adasum_ref
from hvd_spark.runner import run_local
from tests.integration import parity_jobs as jobs


def test_failed_calls_never_shift_automatic_names():
    logs = run_local(jobs.aligned_after_failures, num_proc=2, env={"HVD_SPARK_TIMEOUT": "20"})
    assert [e[:2] for e in logs[0]] == [e[:2] for e in logs[1]]
    for log in logs:
        assert len(log) == 30
        for step, entry in enumerate(log):
            if step % 5 in (1, 2, 3):
                # Failed on every rank, whichever rank's local checks caught it.
                assert entry[0] == "error", entry
            else:
                # Every successful call after a failure still pairs with the right partner.
                assert entry == ("ok", step, [2.0 * step + 1] * 2), entry


def test_join_stands_in_with_zeros_and_returns_the_last_rank():
    results = run_local(jobs.join_uneven, num_proc=3)
    n = 3
    for r, out in enumerate(results):
        assert out["last"] == 2  # rank 2 has the most batches: it joins last
        for step, summed in enumerate(out["sums"]):
            # Ranks that have joined contribute zeros; the others their r + 1.
            expected = sum(k + 1 for k in range(n) if step < k + 2)
            assert summed == [expected] * 3, (r, step, summed)
        assert out["avg_after"] == [1.0, 1.0]


def test_join_refuses_other_collectives_clearly():
    results = run_local(jobs.join_refuses_allgather, num_proc=2)
    assert results[0] == "joined"
    assert "called join()" in results[1] and "only allreduce" in results[1]


def test_process_sets_are_real_subgroups():
    results = run_local(jobs.process_sets, num_proc=3)
    for r in (0, 2):
        out = results[r]
        assert out["id"] == 1 and out["size"] == 2 and out["included"]
        assert out["set_rank"] == (0 if r == 0 else 1)
        assert out["sum"] == [2.0, 2.0]  # 0 + 2: rank 1 is not in it
        assert out["bcast"] == [20]  # root_rank is a global rank, as in Horovod
        assert out["gather"] == [0, 2]
        assert out["rs"] == ([0.0, 4.0] if r == 0 else [8.0, 12.0])
    outside = results[1]
    assert outside["included"] is False and outside["set_rank"] == -1
    assert "rank 1 is not a member" in outside["outside"]
    for out in results:
        assert out["global"] == [3.0]
        assert out["duplicate"] == "ConfigError"
        assert out["removed"] is True and out["removed_again"] is False


@pytest.mark.parametrize("num_proc", [2, 4])
def test_adasum_matches_the_published_algorithm(num_proc):
    rng = np.random.default_rng(num_proc)
    vectors = [rng.normal(size=33).astype(np.float32).tolist() for _ in range(num_proc)]
    vectors[1] = (np.asarray(vectors[0]) * 2).tolist()  # parallel pair: averaged, not added
    results = run_local(jobs.adasum, args=(vectors,), num_proc=num_proc)
    # Reference: pairwise, level by level, straight from the formula.
    level = [np.asarray(v, np.float64) for v in vectors]
    while len(level) > 1:
        pairs = []
        for a, b in zip(level[::2], level[1::2]):
            dot = a @ b
            pairs.append((1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b)
        level = pairs
    np.testing.assert_allclose(results[0], level[0], rtol=1e-5, atol=1e-6)
    assert all(r == results[0] for r in results)  # bitwise equal on every rank
    # Parallel vectors a and 2a combine to 1.5a (their mean), not to their sum 3a.
    a = np.asarray(vectors[0], np.float64)
    np.testing.assert_allclose(adasum_ref.combine(a, 2 * a), 1.5 * a)
    orth = adasum_ref.combine(np.array([1.0, 0.0]), np.array([0.0, 1.0]))
    assert orth.tolist() == [1.0, 1.0]  # orthogonal gradients add up


def test_collectives_from_several_threads_never_deadlock():
    for errors, results, alive in run_local(jobs.threads_and_names, num_proc=2):
        assert errors == [] and not any(alive)
        assert results == [[16.0] * 20] * 4


def test_timeline_records_every_phase(tmp_path):
    path = str(tmp_path / "timeline.json")
    out = run_local(jobs.timeline, args=(path,), num_proc=2)[0]
    events = out["events"]
    rows = {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e["name"] == "process_name" and e["pid"] > 0}
    assert "allreduce.known" in rows.values()
    assert "allreduce.allreduce.noname.0" not in rows.values()
    known = next(pid for pid, name in rows.items() if name == "allreduce.known")
    phases = [(e["ph"], e.get("name")) for e in events if e.get("pid") == known
              and e.get("ph") in ("B", "E")]
    begun = [name for ph, name in phases if ph == "B"]
    assert begun[:3] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE"]
    assert "EAGER_ALLREDUCE" in begun  # small: reduced during negotiation, no ring
    assert sum(ph == "B" for ph, _ in phases) == sum(ph == "E" for ph, _ in phases)
    assert any(e.get("name") == "CYCLE_START" for e in events)
    meta = next(e for e in events if e.get("pid") == 0 and e["name"] == "process_name")
    assert "start_time_since_epoch_in_micros" in meta["args"]


def test_horovod_variables_are_honoured_or_named_once():
    import os
    import subprocess
    import sys

    code = ("import logging, hvd_spark.collectives as h, hvd_spark.collectives._plumbing as p\n"
            "h.init(); h.shutdown(); h.init()\n"
            "print(logging.getLogger('hvd_spark').level,\n"
            "      p.current_engine().config.fusion_threshold)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVD_SPARK", "HOROVOD"))}
    env.update(HOROVOD_LOG_LEVEL="DEBUG", HOROVOD_CCL_CACHE="1", HOROVOD_FUSION_THRESHOLD="1024",
               HOROVOD_DYNAMIC_PROCESS_SETS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["10", "1024"]  # DEBUG level; Horovod's fusion threshold used
    warnings = [ln for ln in out.stderr.splitlines() if "ignores these Horovod settings" in ln]
    assert len(warnings) == 1 and "HOROVOD_CCL_CACHE" in warnings[0]
    assert "DYNAMIC_PROCESS_SETS" not in warnings[0]


def test_stall_shutdown_time_fails_a_stalled_tensor_early():
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2",
           "HVD_SPARK_TIMEOUT": "60"}
    out = run_local(jobs.stalled, num_proc=2, env=env)[0]
    assert "did not submit it within 2.0 s" in out["error"] and out["seconds"] < 10
