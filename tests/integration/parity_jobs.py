"""Worker functions for the Horovod-parity tests (importable by the ranks)."""

from __future__ import annotations

import json
import threading

import numpy as np

import hvd_spark.collectives as hvd
from hvd_spark.errors import CollectiveError


def aligned_after_failures() -> list:
    """A long run of unnamed calls where some fail on one rank only or on all ranks."""
    hvd.init()
    r = hvd.rank()
    log = []
    for step in range(30):
        try:
            if step % 5 == 1:  # rank 1 passes an unsupported object: fails locally, only there
                value = [1, 2] if r == 1 else np.ones(2)
                hvd.allreduce(value)
            elif step % 5 == 2:  # ranks disagree on the dtype: the coordinator refuses it
                hvd.allreduce(np.ones(3, np.float32 if r == 0 else np.float64))
            elif step % 5 == 3:  # a bad root on one rank only
                hvd.broadcast(np.ones(2), root_rank=7 if r == 0 else 0,
                              process_set=hvd.global_process_set)
            else:
                out = hvd.allreduce(np.full(2, float(r + step)), op=hvd.Sum)
                log.append(("ok", step, out.tolist()))
                continue
            log.append(("no error", step))
        except (CollectiveError, ValueError) as exc:
            log.append(("error", step, type(exc).__name__))
    hvd.barrier()
    return log


def join_uneven() -> dict:
    """Rank r has r + 2 batches; every rank joins when its data ends."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    sums = []
    for step in range(r + 2):
        sums.append(hvd.allreduce(np.full(3, float(r + 1)), name=f"grad.{step}",
                                  op=hvd.Sum).tolist())
    last = hvd.join()
    avg_after = hvd.allreduce(np.full(2, float(r)))  # everyone is back: a normal allreduce
    return {"sums": sums, "last": last, "avg_after": avg_after.tolist(), "n": n}


def join_refuses_allgather() -> str:
    hvd.init()
    if hvd.rank() == 0:
        hvd.join()
        return "joined"
    try:
        hvd.allgather(np.ones(2))
        result = "no error"
    except CollectiveError as exc:
        result = str(exc)
    hvd.join()
    return result


def process_sets() -> dict:
    """Three ranks; a set {0, 2}; rank 1 is outside it."""
    hvd.init()
    r = hvd.rank()
    ps = hvd.add_process_set([0, 2])
    out: dict = {"id": ps.process_set_id, "size": ps.size(), "included": ps.included(),
                 "set_rank": ps.rank()}
    if ps.included():
        out["sum"] = hvd.allreduce(np.full(2, float(r)), op=hvd.Sum, process_set=ps).tolist()
        out["bcast"] = hvd.broadcast(np.array([r * 10]), root_rank=2, process_set=ps).tolist()
        out["gather"] = hvd.allgather(np.array([r]), process_set=ps).tolist()
        out["rs"] = hvd.reducescatter(np.arange(4.0) * (r + 1), op=hvd.Sum,
                                      process_set=ps).tolist()
        hvd.barrier(process_set=ps)
    else:
        try:
            hvd.allreduce(np.ones(2), process_set=ps)
            out["outside"] = "no error"
        except ValueError as exc:
            out["outside"] = str(exc)
    out["global"] = hvd.allreduce(np.full(1, 1.0), op=hvd.Sum).tolist()
    try:
        hvd.add_process_set([2, 0])
        out["duplicate"] = "no error"
    except ValueError as exc:
        out["duplicate"] = type(exc).__name__
    out["removed"] = hvd.remove_process_set(ps)
    out["removed_again"] = hvd.remove_process_set(ps)
    return out


def adasum(vectors: list) -> list:
    hvd.init()
    mine = np.asarray(vectors[hvd.rank()], np.float32)
    return hvd.allreduce(mine, op=hvd.Adasum).tolist()


def threads_and_names() -> list:
    """Four threads each run unnamed allreduces at once: nothing deadlocks."""
    hvd.init()
    results: list = [None] * 4
    errors: list = []

    def work(i: int) -> None:
        try:
            results[i] = [hvd.allreduce(np.ones(8), name=f"t{i}.{k}", op=hvd.Sum).sum()
                          for k in range(20)]
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    unnamed = [threading.Thread(target=lambda: hvd.allreduce(np.ones(4))) for _ in range(4)]
    for t in unnamed:
        t.start()
    for t in unnamed:
        t.join(60)
    return [errors, results, [t.is_alive() for t in threads + unnamed]]


def timeline(path: str) -> dict:
    hvd.init()
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(np.ones(4), name="known")
    hvd.allreduce(np.ones(4))
    hvd.stop_timeline()
    if hvd.rank() != 0:
        return {}
    with open(path) as f:
        events = json.load(f)
    return {"events": events}


def stalled() -> dict:
    """Rank 1 comes late to one allreduce; rank 0 gives up at the stall shutdown time."""
    import time

    hvd.init()
    if hvd.rank() == 1:
        time.sleep(5)
        try:
            hvd.allreduce(np.ones(1), name="late")
        except CollectiveError:
            pass
        return {}
    start = time.monotonic()
    try:
        hvd.allreduce(np.ones(1), name="late")
        error = "no error"
    except CollectiveError as exc:
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - start}
