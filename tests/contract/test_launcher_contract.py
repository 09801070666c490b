"""Every launcher keeps the ``Launcher`` contract: the same checks, run against each one.

Local processes, Spark barrier tasks on ``local[2]``, ``mpirun`` and the elastic jobs
(local processes, Spark tasks) need neither root nor sshd. The ssh launcher is the local
launcher's subclass; its contract runs on real hosts in ``tests/multihost`` (network
namespaces, root and sshd).
"""

from __future__ import annotations

import dataclasses
import os
import time

import cloudpickle
import pytest

from hvd_spark.errors import WorkerFailedError
from hvd_spark.runner import worker
from hvd_spark.runner.elastic.elastic_local import ElasticLocalJob
from hvd_spark.runner.elastic.elastic_spark import ElasticSparkJob
from hvd_spark.runner.local.local_launcher import LocalJob
from hvd_spark.runner.local.mpi_launcher import MpiJob
from hvd_spark.runner.run_config import ElasticConfig, RunConfig, Timeouts
from hvd_spark.runner.spark.spark_launcher import SparkJob

NUM_PROC = 2
# A stopped rank is gone within the stop grace; Spark adds its task's kill and reap.
STOP_DEADLINE_S = 15.0
TIMEOUTS = Timeouts(start_timeout_s=60.0, heartbeat_s=10.0, stop_grace_s=2.0)
CONFIG = RunConfig(num_proc=NUM_PROC, timeouts=TIMEOUTS)
ELASTIC = dataclasses.replace(
    ElasticConfig(num_proc=NUM_PROC, min_np=NUM_PROC, max_np=NUM_PROC), timeouts=TIMEOUTS)


def _rank() -> int:
    if os.environ.get("HVD_SPARK_ELASTIC") == "1":
        import hvd_spark.collectives as hvd

        hvd.init()  # an elastic worker learns its rank by joining the ring
        return hvd.rank()
    return int(os.environ["HVD_SPARK_RANK"])


def rank_times_ten() -> int:
    rank = _rank()
    time.sleep(0.3 if rank == 0 else 0.0)  # rank 0 ends last: order is by rank, not time
    return rank * 10


def rank_one_fails() -> int:
    if _rank() == 1:
        raise ValueError("rank one broke on purpose")
    return 0


def write_pid_then_sleep(folder: str) -> None:
    with open(os.path.join(folder, f"{_rank()}.pid"), "w") as out:
        out.write(str(os.getpid()))
    time.sleep(120)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


class LauncherContract:
    """The checks; a subclass provides ``launcher``: a factory of fresh launchers."""

    def test_results_come_back_in_rank_order(self, launcher):
        with launcher() as job:
            results = job.run(worker.pickle_job(rank_times_ten, (), {}))
        assert [cloudpickle.loads(r) for r in results] == [0, 10]

    def test_a_failing_rank_reaches_the_caller_with_its_rank_and_traceback(self, launcher):
        with launcher() as job:
            job.publish(worker.pickle_job(rank_one_fails, (), {}))
            job.start()
            failures = job.watch()
            with pytest.raises(WorkerFailedError) as caught:
                job.collect()
        assert failures
        root = caught.value.root_cause
        assert root.rank == 1
        assert "ValueError: rank one broke on purpose" in root.message
        assert "rank_one_fails" in root.traceback
        assert "rank 1" in str(caught.value)

    def test_stop_ends_every_rank_process_within_the_deadline(self, launcher, tmp_path):
        with launcher() as job:
            job.publish(worker.pickle_job(write_pid_then_sleep, (str(tmp_path),), {}))
            job.start()
            deadline = time.monotonic() + TIMEOUTS.start_timeout_s
            while len(list(tmp_path.glob("*.pid"))) < NUM_PROC:
                assert time.monotonic() < deadline, "the ranks did not start"
                time.sleep(0.1)
            pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
            stopped_at = time.monotonic()
            job.stop()
            while any(_alive(pid) for pid in pids):
                assert time.monotonic() - stopped_at < STOP_DEADLINE_S, (
                    f"rank processes {[p for p in pids if _alive(p)]} outlived stop()")
                time.sleep(0.1)


class TestLocalLauncher(LauncherContract):
    @pytest.fixture
    def launcher(self):
        return lambda: LocalJob(CONFIG)


class TestMpiLauncher(LauncherContract):
    @pytest.fixture
    def launcher(self):
        return lambda: MpiJob(CONFIG)


class TestElasticLocalLauncher(LauncherContract):
    @pytest.fixture
    def launcher(self):
        return lambda: ElasticLocalJob(ELASTIC, cooldown=None)


class TestElasticSparkLauncher(LauncherContract):
    @pytest.fixture
    def launcher(self, spark):
        return lambda: ElasticSparkJob(ELASTIC, spark=spark)


class TestSparkLauncher(LauncherContract):
    @pytest.fixture
    def launcher(self, spark):
        return lambda: SparkJob(CONFIG, spark=spark)
