"""Spark's verdict on a failed barrier job becomes failure records for the ranks it lost."""

from __future__ import annotations

import pickle

from hvd_spark.errors import WorkerFailedError
from hvd_spark.runner.failures import WorkerFailure
from hvd_spark.runner.rendezvous import TaskSlot, assign_ranks
from hvd_spark.runner.spark.task_loss import lost_task_failures, read_verdict

# The shape of what collect() raises when an executor dies under a barrier stage.
_EXECUTOR_LOST = (
    "An error occurred while calling o145.collectToPython.\n"
    ": org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover "
    "from a failed barrier ResultStage. Most recent failure reason: Stage failed because "
    "barrier task ResultTask(1, 0) finished unsuccessfully.\n"
    "ExecutorLostFailure (executor 2 exited caused by one of the running tasks) Reason: "
    "Command exited with code 137\n"
    "\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(x.scala:1)\n"
    "\tat scala.collection.immutable.List.foreach(List.scala:334)\n"
)
_CANCELLED = ("An error occurred while calling o9.collectToPython.\n: org.apache.spark."
              "SparkException: Job 3 cancelled part of cancelled job group hvd_spark-x\n"
              "\tat org.apache.spark.scheduler.DAGScheduler.handleJobCancellation(x:1)\n")


def _ranks():
    # Partition 0 on host-b, partition 1 on host-a: partition order is not rank order.
    return assign_ranks([TaskSlot(0, "host-b"), TaskSlot(1, "host-a")])


def test_verdict_names_partition_executor_and_reason_without_the_jvm_stack():
    verdict = read_verdict(RuntimeError(_EXECUTOR_LOST))
    assert verdict.partition == 0
    assert verdict.executor == "2"
    assert verdict.reason == ("exited caused by one of the running tasks; "
                              "Command exited with code 137")
    assert "DAGScheduler" not in verdict.summary
    assert verdict.summary.startswith("Could not recover from a failed barrier ResultStage")


def test_lost_executor_is_the_root_cause_and_the_survivors_disconnect_secondary():
    ranks = _ranks()
    lost_rank = ranks[0].rank
    survivor = ranks[1].rank
    early = WorkerFailure(survivor, "host-a", "CollectiveTimeoutError: allreduce 'w' timed out",
                          timestamp=1.0)
    failures = lost_task_failures(read_verdict(RuntimeError(_EXECUTOR_LOST)),
                                  {survivor: early}, set(), ranks, 2)
    err = WorkerFailedError(list(failures.values()))
    assert err.root_cause.rank == lost_rank
    assert err.root_cause.host == "host-b"
    assert err.root_cause.lost and not err.root_cause.secondary
    assert err.root_cause.message.startswith(
        "executor 2 lost (exited caused by one of the running tasks; Command exited with "
        "code 137); its Spark task (partition 0)")
    assert failures[survivor].secondary  # the timeout was only a consequence
    assert f"root cause: rank {lost_rank} on host host-b: executor 2 lost" in str(err)
    assert pickle.loads(pickle.dumps(err)).root_cause == err.root_cause


def test_survivor_that_exited_is_not_given_a_record():
    ranks = _ranks()
    failures = lost_task_failures(read_verdict(RuntimeError(_EXECUTOR_LOST)), {},
                                  {ranks[1].rank}, ranks, 2)
    assert list(failures) == [ranks[0].rank]


def test_silent_survivor_gets_a_secondary_record():
    ranks = _ranks()
    failures = lost_task_failures(read_verdict(RuntimeError(_EXECUTOR_LOST)), {}, set(),
                                  ranks, 2)
    survivor = failures[ranks[1].rank]
    assert survivor.secondary and survivor.lost
    assert "aborted the barrier stage" in survivor.message


def test_a_user_error_stays_the_root_cause_when_spark_names_no_task():
    ranks = _ranks()
    bug = WorkerFailure(1, "host-a", "ValueError: bad shape", traceback="tb", timestamp=1.0)
    failures = lost_task_failures(read_verdict(RuntimeError(_CANCELLED)), {1: bug}, set(),
                                  ranks, 2)
    err = WorkerFailedError(list(failures.values()))
    assert err.root_cause is bug
    assert failures[0].secondary


def test_unexplained_vanishing_is_primary_with_sparks_words():
    failures = lost_task_failures(read_verdict(RuntimeError(_CANCELLED)), {}, set(),
                                  _ranks(), 2)
    assert all(not f.secondary and f.lost for f in failures.values())
    assert all("cancelled part of cancelled job group" in f.message for f in failures.values())


def test_executor_lost_before_ranks_were_assigned_names_the_partition():
    failures = lost_task_failures(read_verdict(RuntimeError(_EXECUTOR_LOST)), {}, set(), {}, 2)
    assert "partition 0 (before ranks were assigned)" in failures[0].message
    assert failures[0].lost and failures[1].secondary


def test_killed_process_is_lost_but_a_torn_down_one_is_not():
    assert WorkerFailure.from_exit(0, "h", -9, torn_down=False).lost
    assert not WorkerFailure.from_exit(0, "h", -15, torn_down=True).lost
    assert not WorkerFailure.from_exit(0, "h", 1, torn_down=False).lost


def test_a_disconnect_wrapped_by_tensorflow_is_a_consequence():
    ranks = _ranks()
    survivor = ranks[1].rank
    wrapped = WorkerFailure(survivor, "host-a", "UnknownError: Graph execution error: ... "
                            "PeerDisconnectedError: collective 'g' cannot run", timestamp=1.0)
    failures = lost_task_failures(read_verdict(RuntimeError(_EXECUTOR_LOST)),
                                  {survivor: wrapped}, set(), ranks, 2)
    assert failures[survivor].secondary
    assert WorkerFailedError(list(failures.values())).root_cause.rank == ranks[0].rank


def test_from_exception_marks_a_wrapped_disconnect_secondary():
    class UnknownError(Exception):
        pass

    exc = UnknownError("Graph execution error: PeerDisconnectedError: rank 1 disconnected")
    assert WorkerFailure.from_exception(0, "h", exc).secondary
    assert not WorkerFailure.from_exception(0, "h", ValueError("bad shape")).secondary
