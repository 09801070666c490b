"""``hvd_spark.run_elastic`` on real Spark: an executor JVM killed mid-training on
local-cluster[3,1,1024] costs only the work since the last commit."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import threading

import cloudpickle
import pytest

import hvd_spark
from hvd_spark.errors import ConfigError, WorkerFailedError
from tests.conftest import _session
from tests.integration import collective_jobs as jobs
from tests.integration import elastic_jobs
from tests.integration.elastic_jobs import count_steps

# tests/ is not on the workers' path: ship these modules' functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(jobs)
cloudpickle.register_pickle_by_value(elastic_jobs)

STEPS = 120


@pytest.fixture(scope="module")
def spark_three_executors():
    """Three executor JVMs with one slot each; Spark may retry a lost task."""
    # Not stopped here: the next module's _session() replaces it, as for the other
    # module-scoped sessions (a stopped active session breaks the next getOrCreate).
    return _session("local-cluster[3,1,1024]")


class KillExecutorAt:
    """Output stream that kills the executor JVM named by partition 1's line at ``step``."""

    def __init__(self, step: int) -> None:
        self.pattern = re.compile(rf"^\[1\] step {step} size \d+ executor (\d+)", re.M)
        self.killed: int | None = None
        self.text = io.StringIO()
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self.text.write(text)
            match = self.pattern.search(text)
            if match and self.killed is None:
                self.killed = int(match.group(1))
                os.kill(self.killed, signal.SIGKILL)
        return len(text)

    def flush(self) -> None:
        pass


def _executor_pid() -> int:
    """The executor JVM above this process (walking up the parent processes)."""
    pid = os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/stat") as stat:
            parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{parent}/cmdline", "rb") as cmd:
            if b"CoarseGrainedExecutorBackend" in cmd.read():
                return parent
        pid = parent
    raise RuntimeError("no executor JVM above this process")


def _train() -> tuple[int, int, int, float]:
    # Each commit line names this rank's executor, which KillExecutorAt kills.
    return count_steps(STEPS, commit_every=5, pause_s=0.05, tag=f"executor {_executor_pid()}")


@pytest.mark.smoke
def test_an_executor_killed_mid_training_does_not_end_the_run(spark_three_executors,
                                                             monkeypatch):
    monkeypatch.setenv("HVD_SPARK_HEARTBEAT_S", "3")
    out, err = KillExecutorAt(step=30), io.StringIO()
    results = hvd_spark.run_elastic(_train, num_proc=3, min_np=2, max_np=3, elastic_timeout=60,
                                    start_timeout=120, stdout=out, stderr=err)
    log = err.getvalue()
    assert out.killed is not None, out.text.getvalue()
    # The driver names the rank, the worker (task 1, attempt 0), its executor and host.
    lost = re.search(r"rank \d \(worker 1\.0, Spark executor \d+ \(pid (\d+)\) on \S+\) lost",
                     log)
    assert lost and int(lost.group(1)) == out.killed, log
    assert re.search(r"generation 2: 2 ranks", log), log
    size = len(results)
    assert size in (2, 3)  # 3 when Spark's retry of the lost task joined before the end
    assert [r[:3] for r in results] == [(rank, size, STEPS) for rank in range(size)]
    # Everyone agrees on the state, and the lost work was redone: every step counted
    # at least two ranks, at most three.
    assert len({r[3] for r in results}) == 1
    assert 2 * STEPS <= results[0][3] <= 3 * STEPS


def test_ranks_killed_one_after_another_are_replaced_by_new_attempts(spark_three_executors):
    """Found by the chaos soak: a task whose worker process was killed (or froze and was
    dropped) ended normally, so Spark never ran it again and its slot was gone for good;
    after two such losses 1 of 3 workers was left, below min_np=2, and the run failed."""
    err = io.StringIO()
    results = hvd_spark.run_elastic(
        elastic_jobs.count_steps_killing, args=(60, {"1.0": 10, "2.0": 30}), num_proc=3,
        min_np=2, max_np=3, elastic_timeout=120, start_timeout=120, stderr=err,
        env={"HVD_SPARK_HEARTBEAT_S": "3"})
    log = err.getvalue()
    assert [r[2] for r in results] == [60] * len(results) and len(results) >= 2, log
    assert len({r[3] for r in results}) == 1, results
    # Both losses were replaced: a second attempt of a killed task joined a ring.
    assert re.search(r"worker [12]\.1", log) or len(results) == 3, log


def test_a_bug_in_fn_ends_the_elastic_run_with_its_traceback(spark):
    def fn():
        import hvd_spark.collectives as hvd

        hvd.init()
        if hvd.rank() == 0:
            raise KeyError("label column")
        hvd.barrier()

    with pytest.raises(WorkerFailedError, match="KeyError: 'label column'"):
        hvd_spark.run_elastic(fn, num_proc=2, min_np=1, start_timeout=60)


def test_min_np_above_the_task_slots_is_refused_before_starting(spark):
    with pytest.raises(ConfigError, match="min_np=5"):
        hvd_spark.run_elastic(lambda: 1, num_proc=5, min_np=5)


def test_a_frozen_rank_under_hvd_spark_run_fails_the_run_within_the_heartbeat(spark):
    """Fixed-size runs beat too: a frozen rank is the named root cause in seconds."""
    import time

    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        hvd_spark.run(jobs.freeze_rank_one, num_proc=2, start_timeout=60,
                      env={"HVD_SPARK_HEARTBEAT_S": "3", "HVD_SPARK_TIMEOUT": "300"})
    assert time.monotonic() - started < 120  # not the 300 s collective timeout
    root = info.value.root_cause
    assert root.rank == 1 and "sent no heartbeat" in root.message and root.lost
    # The survivor heard why before it was stopped (issue 47): its error names rank 1.
    survivor = next(f for f in info.value.failures if f.rank == 0)
    assert "rank 1 sent no heartbeat" in survivor.message, survivor.message
