"""The soak's three workloads, run from the driver while faults land on the hosts.

- ``fit``: a ``TorchEstimator`` fit with a Store that checkpoints every few steps and
  resumes by itself; checked bitwise against a fault-free fit of the same seed.
- ``elastic``: a ``run_elastic`` loop on 3 ranks with ``min_np=2``; checked for its step
  count and the same state on every rank.
- ``distributor``: torch DDP jobs through ``hvd_spark.TorchDistributor``, one after
  another; a fault must end its job fast with a named error and nothing left running,
  and a last fault-free job must train.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from hvd_spark.bench.chaos import hostprocs, rank_jobs
from hvd_spark.bench.chaos.events import Event, Events, LineTap
from hvd_spark.errors import HvdSparkError, WorkerFailedError

if TYPE_CHECKING:
    from netns_cluster.hosts import NetnsHosts

RANKS = 3
#: Sleep per training step: about 3-5 steps a second, so faults spread over time.
PAUSE_S = 0.2
TAIL_STEPS = 40
#: Steps per fault beyond its gap, per workload: training may go on while a fault settles
#: (up to its duration plus ``injector.DETECT_GRACE_S``: about 30 s, 120 steps, where an
#: elastic ring goes on without the lost rank; a fit stalls until it resumes).
SLACK_STEPS = {"fit": 30, "elastic": 120, "distributor": 0}
_GONE_WAIT_S = 60.0
_SLOTS_WAIT_S = 180.0


@dataclasses.dataclass
class Context:
    """What a workload runs with: the cluster, the soak's record and its files."""

    net: NetnsHosts
    spark: Any
    events: Events
    workdir: str
    progress: str
    deadline: float
    faults_done: threading.Event  # set once the injector has nothing more to do


def wait_slots(ctx: Context, wanted: int = RANKS) -> None:
    """Until the session has ``wanted`` executors again (a killed one is replaced)."""
    sc = ctx.spark.sparkContext
    end = min(time.time() + _SLOTS_WAIT_S, ctx.deadline)
    while sc._jsc.sc().getExecutorMemoryStatus().size() - 1 < wanted:
        if time.time() > end:
            raise HvdSparkError(f"the cluster did not get {wanted} executors back within "
                                f"{_SLOTS_WAIT_S:.0f} s")
        time.sleep(0.5)


def ranks_gone(net: NetnsHosts, timeout: float = _GONE_WAIT_S) -> float | None:
    """Seconds until no rank process runs on any host (None: some still ran at timeout)."""
    start = time.time()
    while time.time() - start < timeout:
        if not any(hostprocs.matching(net, i, hostprocs.RANK_MARK) for i in range(net.count)):
            return time.time() - start
        time.sleep(0.2)
    return None


# ---------------------------------------------------------------------- fit
def _frame(spark: Any) -> Any:
    import numpy as np
    from pyspark.ml.feature import VectorAssembler

    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 3))
    rows = [(float(a), float(b), float(c), float(a - 2 * b + 0.5 * c)) for a, b, c in x]
    df = spark.createDataFrame(rows, "a double, b double, c double, y double")
    return VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(df)


def _estimator(store: str, run_id: str, progress: str, epochs: int, retries: int) -> Any:
    import torch

    from hvd_spark.estimator import TorchEstimator

    torch.manual_seed(0)
    model = rank_jobs.ChaosNet(progress, PAUSE_S)
    return TorchEstimator(
        num_proc=RANKS, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["y"], batch_size=16,
        epochs=epochs, train_steps_per_epoch=20, checkpoint_every_steps=5, random_seed=7,
        store=store, run_id=run_id, verbose=0, max_retries=retries)


def run_fit(ctx: Context, steps: int, faults: int) -> list[str]:
    """A fault-free fit, then the same fit under faults; problems found (empty: none)."""
    import torch

    epochs = max(2, math.ceil(steps / 20))
    store = os.path.join(ctx.workdir, "store")
    frame = _frame(ctx.spark)
    reference = _estimator(store, "reference", "", epochs, 0).fit(frame)
    ctx.events.add(Event(time.time(), "started"))
    wait_slots(ctx)
    fitted = _estimator(store, "chaos", ctx.progress, epochs, faults + 2).fit(frame)
    ctx.events.add(Event(time.time(), "finished"))
    problems = []
    a, b = reference.getModel().state_dict(), fitted.getModel().state_dict()
    for name in a:
        if not torch.equal(a[name], b[name]):
            diff = (a[name].double() - b[name].double()).abs().max().item()
            problems.append(f"fit: {name} differs from the fault-free fit's (max |diff| "
                            f"{diff:.3g})")
    if int(b["steps"]) != epochs * 20:
        problems.append(f"fit: {int(b['steps'])} training steps, not {epochs * 20}")
    return problems


# ---------------------------------------------------------------------- elastic
def run_elastic(ctx: Context, steps: int, faults: int) -> list[str]:
    """The elastic loop under faults; problems found (empty: none)."""
    import hvd_spark

    out = LineTap(ctx.events, os.path.join(ctx.workdir, "ranks.log"))
    ctx.events.add(Event(time.time(), "started"))
    results = hvd_spark.run_elastic(
        rank_jobs.elastic_loop, args=(steps, 5, ctx.progress, PAUSE_S), num_proc=RANKS,
        min_np=2, max_np=RANKS, start_timeout=120, elastic_timeout=120, stdout=out,
        stderr=out)
    ctx.events.add(Event(time.time(), "finished"))
    problems = []
    if not results or [r[0] for r in results] != list(range(len(results))):
        problems.append(f"elastic: results are not one per rank in order: {results}")
    for rank, size, step, weights in results:
        if step != steps or size != len(results):
            problems.append(f"elastic: rank {rank} ended at step {step} of {steps}, size "
                            f"{size} with {len(results)} results")
        if weights != results[0][3]:
            problems.append(f"elastic: rank {rank}'s state differs from rank 0's")
    return problems


# ---------------------------------------------------------------------- distributor
def run_distributor(ctx: Context, steps: int, faults: int) -> list[str]:
    """DDP jobs until the faults are done, then one more that must finish; problems found."""
    from hvd_spark import TorchDistributor

    problems: list[str] = []
    ctx.events.add(Event(time.time(), "started"))
    job_steps = 100
    last_clean = False
    while time.time() < ctx.deadline:
        done_before = ctx.faults_done.is_set()
        wait_slots(ctx)
        try:
            TorchDistributor(num_processes=RANKS, local_mode=False, use_gpu=False).run(
                rank_jobs.ddp_loop, job_steps, ctx.progress, PAUSE_S)
            last_clean = done_before
        except WorkerFailedError as err:
            root = err.root_cause
            ctx.events.add(Event(time.time(), "ended",
                                 text=f"rank {root.rank} on {root.host}: {root.message}"))
            gone = ranks_gone(ctx.net)
            if gone is None:
                problems.append(f"distributor: rank processes still ran {_GONE_WAIT_S:.0f} s "
                                f"after the job failed ({err.root_cause.message})")
        if last_clean:
            break
    ctx.events.add(Event(time.time(), "finished"))
    if not last_clean:
        problems.append("distributor: no fault-free DDP job finished after the faults")
    return problems


WORKLOADS = {"fit": run_fit, "elastic": run_elastic, "distributor": run_distributor}
#: Steps of training between faults (drawn per fault), per workload.
GAPS = {"fit": (15, 45), "elastic": (15, 45), "distributor": (5, 80)}
