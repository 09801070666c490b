"""Elastic training on real local processes: ``hvdrun --min-np/--max-np`` and
``run_elastic_local``, with ranks killed (SIGKILL) or frozen (SIGSTOP) mid-training."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hvd_spark.errors import ConfigError, WorkerFailedError
from hvd_spark.runner.elastic.elastic_local import run_elastic_local
from hvd_spark.runner.local.local_launcher import run_local
from tests.integration import collective_jobs as jobs

JOB = str(Path(__file__).with_name("elastic_torch_job.py"))


def _hvdrun(args: list[str], env: dict[str, str], timeout: float = 150) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "hvd_spark.runner", *args, sys.executable, JOB],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _lines(out: str, worker: str, word: str) -> list[dict[str, str]]:
    found = []
    for line in out.splitlines():
        if line.startswith(f"[{worker}] {word} "):
            found.append(dict(re.findall(r"(\w+)=(\S+)", line)))
    return found


def test_kill_minus_9_mid_epoch_survivors_finish_from_the_last_commit():
    code, out = _hvdrun(["-np", "3", "--min-np", "2", "--max-np", "3", "--cooldown", "-1"],
                        {"KILL_AT": "11", "EPOCHS": "3"})
    assert code == 0, out
    assert "rank 1 (worker 1 on" in out and "exited with code -9" in out
    assert re.search(r"generation 2: 2 ranks", out), out
    for worker in ("0", "2"):
        starts = _lines(out, worker, "start")
        # The second start resumes from the last commit before the kill (step 10).
        assert [s["step"] for s in starts] == ["0", "10"], out
        assert starts[1]["size"] == "2"
        done = _lines(out, worker, "done")[0]
        assert done["step"] == "24" and done["size"] == "2"
        # Every rank ends with the same parameters (checksum of the max equals its own).
        assert done["checksum"] == done["local"]
        commits = [int(c["step"]) for c in _lines(out, worker, "commit")]
        assert commits == sorted(commits) and commits[-1] == 24
    assert _lines(out, "0", "done")[0]["local"] == _lines(out, "2", "done")[0]["local"]
    # The survivors' errors name the killed rank, not rank 0 (which passed the cause on).
    lost_lines = [line for line in out.splitlines() if "a rank was lost" in line]
    assert lost_lines and all("rank 1" in line for line in lost_lines), lost_lines
    assert "rank 0 disconnected" not in out


def test_a_replacement_joins_at_a_commit_and_the_ring_grows_back():
    code, out = _hvdrun(["-np", "3", "--min-np", "2", "--max-np", "3", "--cooldown", "0.5"],
                        {"KILL_AT": "5", "EPOCHS": "3", "WAIT_FOR_SIZE": "3"})
    assert code == 0, out
    assert "started worker 3 to replace a lost one" in out, out
    assert re.search(r"generation 3: 3 ranks", out), out
    done = {w: _lines(out, w, "done") for w in ("0", "2", "3")}
    assert all(d and d[0]["size"] == "3" for d in done.values()), out
    # The newcomer took rank 2 (survivors keep ranks 0 and 1) and the same parameters.
    assert done["3"][0]["rank"] == "2"
    assert len({d[0]["local"] for d in done.values()}) == 1


def test_a_frozen_rank_is_detected_by_the_heartbeat_within_seconds():
    started = time.monotonic()
    code, out = _hvdrun(["-np", "3", "--min-np", "2", "--cooldown", "-1"],
                        {"KILL_AT": "5", "EPOCHS": "2", "SIG": str(int(signal.SIGSTOP)),
                         "HVD_SPARK_HEARTBEAT_S": "3"})
    assert code == 0, out
    assert "sent no heartbeat for 3 s" in out, out
    assert _lines(out, "0", "done")[0]["size"] == "2"
    assert time.monotonic() - started < 100  # not the 600 s collective timeout


def test_a_rank_that_exits_slowly_after_training_is_not_declared_lost():
    # Exits take 6 s, twice the heartbeat limit: the ranks keep beating until their
    # processes end (before, they fell silent at exit, were declared lost, and the job
    # waited out the elastic timeout).
    started = time.monotonic()
    code, out = _hvdrun(["-np", "2", "--min-np", "2", "--cooldown", "-1",
                         "--elastic-timeout", "60"],
                        {"EPOCHS": "1", "SLOW_EXIT_S": "6", "HVD_SPARK_HEARTBEAT_S": "3"})
    assert code == 0, out
    assert "sent no heartbeat" not in out and "lost" not in out, out
    assert all(_lines(out, w, "done") for w in ("0", "1")), out
    assert time.monotonic() - started < 55  # not the 60 s elastic timeout


def test_fewer_than_min_np_left_fails_naming_the_lost_rank():
    code, out = _hvdrun(["-np", "2", "--min-np", "2", "--cooldown", "-1",
                         "--elastic-timeout", "3"], {"KILL_AT": "3", "EPOCHS": "2"})
    assert code == 1, out
    assert "elastic job failed" in out
    assert "fewer than min_np=2" in out and "exited with code -9" in out


def test_reset_limit_ends_the_job_with_the_cause():
    code, out = _hvdrun(["-np", "3", "--min-np", "2", "--reset-limit", "0", "--cooldown", "-1"],
                        {"KILL_AT": "3", "EPOCHS": "2"})
    assert code == 1, out
    assert "reset_limit=0" in out and "exited with code -9" in out


def _crash_worker_one(script: Path) -> None:
    script.write_text(
        "import os, runpy, sys\n"
        "if os.environ['HVD_SPARK_WORKER_ID'] == '1':\n"
        "    sys.exit(3)\n"
        f"runpy.run_path({JOB!r}, run_name='__main__')\n")


def test_a_worker_dying_before_the_first_ring_is_not_waited_for(tmp_path):
    script = tmp_path / "crash_one.py"
    _crash_worker_one(script)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "hvd_spark.runner", "-np", "3", "--min-np", "2",
         "--cooldown", "-1", sys.executable, str(script)],
        env={**os.environ, "EPOCHS": "1"}, capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"generation 1: 2 ranks", out), out
    assert time.monotonic() - started < 120  # not the 600 s start timeout
    # Too few left: the job ends at once with the reason.
    proc = subprocess.run(
        [sys.executable, "-m", "hvd_spark.runner", "-np", "2", "--min-np", "2",
         "--cooldown", "-1", sys.executable, str(script)],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "worker 1 exited with code 3 before the first ring formed" in proc.stderr


def test_a_bug_in_fn_is_not_mistaken_for_a_lost_worker():
    def fn():
        import hvd_spark.collectives as hvd

        hvd.init()
        if hvd.rank() == 1:
            raise ValueError("bad batch on rank 1")
        hvd.allreduce(np.ones(2))
        return hvd.rank()

    with pytest.raises(WorkerFailedError, match="bad batch on rank 1"):
        run_elastic_local(fn, num_proc=2, min_np=1, cooldown=None, start_timeout=60)


def _numpy_elastic(kill_step: int) -> list:
    import hvd_spark.collectives as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(step=0, total=0.0)

    @hvd.elastic.run
    def train(state):
        while state.step < 40:
            state.total += float(hvd.allreduce(np.ones(1), op=hvd.Sum)[0])
            state.step += 1
            if state.step == kill_step and os.environ["HVD_SPARK_WORKER_ID"] == "0":
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step % 4 == 0:
                state.commit()
        return hvd.rank(), hvd.size(), state.step, state.total

    return train(state)


def test_run_elastic_local_returns_the_final_ranks_results_in_rank_order():
    # Worker 0 (rank 0) dies at step 10; the last commit was step 8 with total 3 * 8.
    results = run_elastic_local(_numpy_elastic, args=(10,), num_proc=3, min_np=2,
                                cooldown=None, start_timeout=60)
    assert [r[:3] for r in results] == [(0, 2, 40), (1, 2, 40)]
    assert all(r[3] == 3 * 8 + 2 * 32 for r in results)


def test_a_rank_frozen_as_its_ring_forms_does_not_train_on_in_a_ring_given_up():
    # Worker 2 freezes for 6 s right after joining generation 1, before the ring
    # connects; the launcher declares it lost after 2 s of silence. When it resumes,
    # the ring can still connect (the mesh waits 30 s): before the fix the survivors had
    # heard "broken" before their engine existed, forgot it, and trained on in the ring
    # the launcher had given up, and the job never finished.
    from tests.integration.elastic_jobs import count_steps_freezing_in_the_first_ring

    results = run_elastic_local(
        count_steps_freezing_in_the_first_ring, args=(20, "2", 6.0), num_proc=3,
        min_np=2, cooldown=None, start_timeout=60, elastic_timeout=30,
        env={"HVD_SPARK_HEARTBEAT_S": "2"})
    assert [r[:3] for r in results] == [(0, 2, 20), (1, 2, 20)]
    assert results[0][3] == results[1][3] == 2 * 20  # only the second ring's steps count


def test_elastic_settings_are_checked_before_anything_starts():
    with pytest.raises(ConfigError, match="min_np <= num_proc <= max_np"):
        run_elastic_local(_numpy_elastic, args=(0,), num_proc=3, min_np=4)


def test_a_frozen_rank_in_a_fixed_size_job_fails_fast_with_its_name(monkeypatch):
    monkeypatch.setenv("HVD_SPARK_HEARTBEAT_S", "2")
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        run_local(jobs.freeze_rank_one, num_proc=2, env={"HVD_SPARK_TIMEOUT": "120"})
    assert time.monotonic() - started < 60  # the collective timeout is 120 s
    root = info.value.root_cause
    assert root.rank == 1 and "sent no heartbeat" in root.message
