"""Failure records for ranks whose Spark task vanished, read from Spark's own verdict.

When an executor dies (killed, preempted, its host lost), the rank's process and its
Spark task die with it and never report. The surviving ranks then see their peer
disconnect and report that first, although it is only a consequence. Spark says
what really happened when it aborts the barrier stage ("barrier task ResultTask(3, 1)
finished unsuccessfully. ExecutorLostFailure (executor 2 exited ...) Reason: ...");
this module turns that into a record for the rank that was lost and marks the
survivors' collective errors as secondary.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from hvd_spark.runner.failures import WorkerFailure
from hvd_spark.runner.rendezvous import RankInfo

_FAILED_TASK = re.compile(r"barrier task \w*Task\((\d+), (\d+)\)")
_EXECUTOR_LOST = re.compile(
    r"ExecutorLostFailure \(executor (\S+?) ([^)]*)\)(?: Reason: ([^\n]*))?")
_STAGE_FAILURE = "Job aborted due to stage failure:"
# What a survivor raises when its peer vanished: a consequence, never the root cause.
_CONSEQUENCES = ("PeerDisconnectedError", "CollectiveTimeoutError", "HorovodInternalError",
                 "CollectiveError", "RendezvousTimeoutError")
_SUMMARY_LINES = 4


@dataclasses.dataclass(frozen=True)
class SparkVerdict:
    """What Spark said about the failed job.

    Attributes:
        summary: The failure's own lines, without the JVM stack trace.
        partition: The partition of the task Spark names as failed (None if it names none).
        executor: The lost executor's id when the task failed because it was lost.
        reason: Why the executor was lost, in Spark's words ("" when unknown).
    """

    summary: str
    partition: int | None = None
    executor: str | None = None
    reason: str = ""


def read_verdict(error: BaseException) -> SparkVerdict:
    """Read which task failed and why from the exception of the failed Spark job."""
    text = str(error)
    start = text.find(_STAGE_FAILURE)
    body = text[start + len(_STAGE_FAILURE):] if start >= 0 else text
    lines = []
    for line in body.strip().splitlines():
        if line.lstrip().startswith("at ") or line.startswith(("\tat ", "JVM stacktrace")):
            break  # the JVM's stack trace: nothing for the user there
        if line.strip():
            lines.append(line.strip())
    summary = " ".join(lines[:_SUMMARY_LINES]) or type(error).__name__
    task = _FAILED_TASK.search(body)
    lost = _EXECUTOR_LOST.search(body)
    reason = ""
    if lost is not None:
        reason = "; ".join(part.strip() for part in (lost.group(2), lost.group(3) or "")
                           if part and part.strip())
    return SparkVerdict(summary=summary,
                        partition=int(task.group(2)) if task else None,
                        executor=lost.group(1) if lost else None,
                        reason=reason)


def lost_task_failures(
    verdict: SparkVerdict,
    failures: Mapping[int, WorkerFailure],
    accounted: set[int],
    ranks: Mapping[int, RankInfo],
    num_proc: int,
) -> dict[int, WorkerFailure]:
    """The failures after the job failed, with a record for every rank whose task vanished.

    Args:
        verdict: What Spark said (``read_verdict``).
        failures: Rank -> failure recorded so far (reports, exits, task errors).
        accounted: Ranks that reported a result or whose process exit was reported.
        ranks: Partition -> rank assignment (empty when not every task registered:
            records are then keyed by partition).
        num_proc: Number of tasks in the job.

    Returns:
        Rank -> failure. The rank Spark names gets a primary record saying what was lost
        ("executor 2 lost (...)"); other ranks that never reported get a secondary one;
        once a task is known lost, the others' collective errors become secondary.
    """
    out = dict(failures)
    rank_of = {p: info.rank for p, info in ranks.items()}
    host_of = {p: info.host for p, info in ranks.items()}
    failed = verdict.partition
    if failed is not None and 0 <= failed < num_proc:
        rank = rank_of.get(failed, failed)
        current = out.get(rank)
        if rank not in accounted and (current is None or current.secondary):
            out[rank] = WorkerFailure(
                rank=rank, host=host_of.get(failed, "?"), message=_lost_message(verdict, failed,
                                                                                 bool(ranks)),
                lost=verdict.executor is not None)
            out = {r: f if r == rank or not _consequence(f)
                   else dataclasses.replace(f, secondary=True) for r, f in out.items()}
    # Spark named no task and no rank failed by itself: this vanishing is all we know.
    primary = failed is None and all(f.secondary for f in out.values())
    for partition in range(num_proc):
        rank = rank_of.get(partition, partition)
        if rank in out or rank in accounted:
            continue
        # It ended without a word: its process or task vanished, whatever took them.
        out[rank] = WorkerFailure(
            rank=rank, host=host_of.get(partition, "?"), secondary=not primary, lost=True,
            message=("its Spark task ended without reporting"
                     + (f": {verdict.summary}" if primary else
                        " (stopped when Spark aborted the barrier stage)")))
    return out


def _consequence(failure: WorkerFailure) -> bool:
    # Frameworks wrap our errors (TensorFlow: "UnknownError: Graph execution error: ...
    # PeerDisconnectedError: ..."), so the name may come later in the message.
    return failure.message.startswith(_CONSEQUENCES) or any(
        f"{name}: " in failure.message for name in _CONSEQUENCES)


def _lost_message(verdict: SparkVerdict, partition: int, assigned: bool) -> str:
    where = (f"its Spark task (partition {partition})" if assigned
             else f"the Spark task of partition {partition} (before ranks were assigned)")
    if verdict.executor is not None:
        why = f" ({verdict.reason})" if verdict.reason else ""
        return (f"executor {verdict.executor} lost{why}; {where} and the rank's process "
                "vanished with it")
    return f"{where} failed: {verdict.summary}"
