"""One soak: a workload on the namespace cluster, the injector beside it, the checks after.

The workload runs in a thread; the soak waits for it until the deadline. Passing the
deadline is a failure (a hang somewhere): the faults in effect are ended, Spark's jobs
cancelled, and the soak reports what it saw. After the workload: every fault's row, and
nothing left behind on any host (rank processes, /dev/shm files, listening ports).
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hvd_spark.bench.chaos import faults, hostprocs, injector, report, workloads
from hvd_spark.bench.chaos.events import Events, LogTap, ProgressTail

if TYPE_CHECKING:
    from netns_cluster.hosts import NetnsHosts

_LEFTOVER_WAIT_S = 60.0
#: The session's settings for a soak: Spark may retry a task as often as faults kill it.
SPARK_CONF = {"spark.task.maxFailures": "100"}


@dataclasses.dataclass
class SoakResult:
    """What a soak found: one row per fault, the problems (empty: it passed), notes."""

    rows: list[report.Row]
    problems: list[str]
    notes: list[str]
    seconds: float


def fault_kinds(net: NetnsHosts, wanted: Sequence[str] | None = None
                ) -> tuple[list[str], list[str]]:
    """The kinds to draw from (netem becomes slow-link where the kernel lacks netem)."""
    notes = []
    kinds = list(wanted or faults.KINDS)
    if "netem" in kinds:
        why = faults.netem_problem(net)
        if why:
            faults.KINDS["slow-link"] = faults.slow_link
            kinds[kinds.index("netem")] = "slow-link"
            notes.append(f"netem (5% loss, 50 ms delay) cannot run here: {why}; a 1 Mbit/s "
                         f"link for {faults.NETEM_S:.0f} s (tbf) stands in for it")
    return kinds, notes


def _leftovers(net: NetnsHosts) -> list[str]:
    """What stays behind on the hosts once settled (bounded: rank teardown takes a moment)."""
    end = time.time() + _LEFTOVER_WAIT_S
    found = hostprocs.leftovers(net)
    while found and time.time() < end:
        time.sleep(1.0)
        found = hostprocs.leftovers(net)
    return found


def soak(net: NetnsHosts, spark: Any, workload: str, count: int, seed: int,
         deadline_s: float, kinds: Sequence[str] | None = None,
         say: Callable[[str], None] = print) -> SoakResult:
    """Run ``workload`` under ``count`` seeded faults; the rows and problems found."""
    if workload not in workloads.WORKLOADS:
        raise ValueError(f"workload {workload!r} is not one of {sorted(workloads.WORKLOADS)}")
    started = time.time()
    deadline = started + deadline_s
    rng = random.Random(seed)
    drawn, notes = fault_kinds(net, kinds)
    planned = injector.plan(rng, count, drawn, workloads.GAPS[workload])
    # Training goes on while a fault settles: room for that, and for the end.
    steps = (sum(p.gap for p in planned) + count * workloads.SLACK_STEPS[workload]
             + workloads.TAIL_STEPS)
    say(f"chaos: {workload}, {count} faults (seed {seed}), {steps} steps, deadline "
        f"{deadline_s:.0f} s; plan: " + ", ".join(
            p.kind + ("*" if p.in_recovery else f"@+{p.gap}") for p in planned))
    for note in notes:
        say(f"chaos: {note}")
    workdir = tempfile.mkdtemp(prefix="hvd-chaos-")
    say(f"chaos: progress and rank logs in {workdir} (removed if every check passes)")
    events = Events()
    ctx = workloads.Context(net, spark, events, workdir, os.path.join(workdir, "progress"),
                            deadline, threading.Event())
    problems: list[str] = []
    workload_done = threading.Event()

    def body() -> None:
        try:
            problems.extend(workloads.WORKLOADS[workload](ctx, steps, count))
        except Exception as err:  # noqa: BLE001 - every failure is a finding
            problems.append(f"{workload}: the workload failed: {type(err).__name__}: "
                            f"{str(err)[:2000]}")
            say(traceback.format_exc())
        finally:
            workload_done.set()

    ports_before = hostprocs.own_listening()
    tail = ProgressTail(ctx.progress, events)
    inject = injector.Injector(net, events, planned, rng, deadline, workload_done)
    runner = threading.Thread(target=body, daemon=True, name="chaos-workload")
    with LogTap(events, os.path.join(workdir, "driver.log")):
        tail.start()
        runner.start()
        inject.start()
        inject.join(max(0.0, deadline - time.time()))
        ctx.faults_done.set()
        runner.join(max(0.0, deadline - time.time()))
        hung = runner.is_alive()
        inject.stop()
        tail.stop()
    if hung:
        problems.append(f"the soak passed its deadline of {deadline_s:.0f} s: the workload "
                        "still ran (a hang)")
        spark.sparkContext.cancelAllJobs()
        runner.join(60)
    if inject.error is not None:
        problems.append(f"the injector failed: {inject.error!r}")
    if len(inject.injected) + len(inject.notes) < count:
        problems.append(f"only {len(inject.injected)} of {count} faults were injected "
                        f"before the workload ended")
    notes += inject.notes
    problems += [f"left behind: {x}" for x in _leftovers(net)]
    problems += [f"left behind: the driver still listens on port {port}"
                 for port in sorted(hostprocs.own_listening() - ports_before)]
    with open(os.path.join(workdir, "events.log"), "w") as f:
        f.writelines(f"{e.at:.3f} {e.kind} {e.n} {e.text}\n" for e in events.since(0.0)
                     if e.kind != "step")
        f.writelines(f"{x.at:.3f} fault {x.kind} {x.where}\n" for x in inject.injected)
    began = events.since(0.0, "started")
    if not problems:  # kept for a look when a check failed
        shutil.rmtree(workdir, ignore_errors=True)
    return SoakResult(report.rows(events, inject.injected, began[0].at if began else started),
                      problems, notes,
                      time.time() - started)
