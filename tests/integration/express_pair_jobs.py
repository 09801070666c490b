"""Two-rank jobs for the TCP engine's express allreduce (``Engine.express_allreduce``).

The workers import these functions; the test process builds its references with
``pairing_jobs.reference``. Each job returns the engine's express counters with its
results, so a test sees which path ran as well as what came out.
"""

from __future__ import annotations

import threading
import time

import numpy as np

import hvd_spark.collectives as hvd
from tests.integration import pairing_jobs

#: Every dtype and op the express path reduces, float16/bfloat16 included.
CASES = [
    ("float32", "Sum"), ("float64", "Average"), ("int64", "Max"), ("int32", "Min"),
    ("float32", "Product"), ("float16", "Sum"), ("bfloat16", "Average"),
]
SIZES = [1, 7, 256]


def case_spec(i: int, limit_bytes: int) -> dict:
    """The ``i``-th call's allreduce: cycling dtypes, ops, sizes (one at the synchronous
    eager limit), in place every other call, a postscale every third."""
    dtype, op = CASES[i % len(CASES)]
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    sizes = [*SIZES, limit_bytes // itemsize]
    floats = dtype.startswith("float") or dtype == "bfloat16"
    return {"name": f"x.{i % 5}", "n": sizes[i % len(sizes)], "dtype": dtype, "op": op,
            "prescale": 1.0, "postscale": 2.0 if floats and i % 3 == 0 and op != "Product"
            else 1.0, "inplace": i % 2 == 0}


def _tensor(spec: dict, rank: int, step: int) -> np.ndarray:
    if spec["dtype"] == "bfloat16":
        import ml_dtypes

        as_f32 = dict(spec, dtype="float32")
        return pairing_jobs.tensor(as_f32, rank, step).astype(ml_dtypes.bfloat16)
    return pairing_jobs.tensor(spec, rank, step)


def _call(spec: dict, rank: int, step: int) -> np.ndarray:
    x = _tensor(spec, rank, step)
    fn = hvd.allreduce_ if spec["inplace"] else hvd.allreduce
    out = fn(x, name=spec["name"], op=getattr(hvd, spec["op"]),
             postscale_factor=spec["postscale"])
    if spec["inplace"] and out is not x:
        raise AssertionError("allreduce_ returned another array than the one it was given")
    return out


def _counters(engine, before: tuple[int, int]) -> dict:
    lane = engine.comm.express_lane
    return {"express": engine.express_rounds - before[0],
            "fallbacks": engine.express_fallbacks - before[1],
            "lane_posts": 0 if lane is None else lane.posted}


def _engine():
    from hvd_spark.collectives import _plumbing

    return _plumbing.current_engine()


def express_rounds(count: int, slow_rank: int | None = None, delay_s: float = 0.0,
                   limit: int | None = None) -> dict:
    """``count`` synchronous allreduces of every kind in ``case_spec``; with
    ``slow_rank``, that rank sleeps ``delay_s`` before each call (the other waits).
    ``limit``: the largest size (default the inline limit, ``lone_eager_bytes``)."""
    hvd.init()
    engine, r = _engine(), hvd.rank()
    limit = limit or engine.lone_eager_bytes
    before = (engine.express_rounds, engine.express_fallbacks)
    results = []
    for i in range(count):
        if r == slow_rank:
            time.sleep(delay_s)
        results.append(_call(case_spec(i, limit), r, i))
    out = {"results": [np.asarray(v, np.float64) for v in results], "limit": limit,
           **_counters(engine, before)}
    hvd.barrier()
    return out


def calls_while_the_progress_lock_is_busy(count: int, hold_s: float) -> dict:
    """``count`` 3 MB in-place Sums; on rank 1 another thread holds the engine's progress
    lock for ``hold_s`` as each call comes, as the background thread does when the
    peer's request of that very call woke it (it copies the tensor out of the lane)."""
    hvd.init()
    engine, r = _engine(), hvd.rank()
    hvd.barrier()
    before = (engine.express_rounds, engine.express_fallbacks)
    ok = True
    for i in range(count):
        x = np.full((3 << 20) // 4 + 3, float(r + i), np.float32)
        holder = None
        if r == 1:
            held = threading.Event()

            def hold(held=held):
                with engine._progress:
                    held.set()
                    time.sleep(hold_s)

            holder = threading.Thread(target=hold)
            holder.start()
            held.wait(5)
        hvd.allreduce_(x, name="busy", op=hvd.Sum)
        if holder is not None:
            holder.join()
        ok = ok and bool(np.all(x == float(2 * i + 1)))
    out = {"exact": ok, **_counters(engine, before)}
    hvd.barrier()
    return out


def submission_during_express(rounds: int, delay_s: float) -> dict:
    """Rank 0's main thread waits in an express allreduce ``y`` that rank 1 calls only
    after ``x``, a large allreduce rank 1 submitted before a barrier (so rank 0's
    coordinator holds its request) and another thread of rank 0 submits ``delay_s``
    later. Only that submission's wake tells the express wait to hand over: ``x`` must
    run at once, not when the wait gives up."""
    hvd.init()
    engine, r = _engine(), hvd.rank()
    before = (engine.express_rounds, engine.express_fallbacks)
    big = 1 << 18  # 1 MB of float32: past the limit of a tensor riding along
    x_times, results = [], []
    for k in range(rounds):
        if r == 0:
            hvd.barrier()
            got: dict = {}

            def submit_x(k=k, got=got) -> None:
                time.sleep(delay_s)
                start = time.monotonic()
                got["x"] = hvd.allreduce(np.full(big, k + 1.0, np.float32), name="x",
                                         op=hvd.Sum)
                got["seconds"] = time.monotonic() - start

            thread = threading.Thread(target=submit_x)
            thread.start()
            y = hvd.allreduce(np.array([10.0 * k]), name="y", op=hvd.Sum)
            thread.join()
            x_times.append(got["seconds"])
            x = got["x"]
        else:
            handle = hvd.allreduce_async(np.full(big, k + 2.0, np.float32), name="x",
                                         op=hvd.Sum)
            hvd.barrier()
            x = hvd.synchronize(handle)
            y = hvd.allreduce(np.array([10.0 * k + 1]), name="y", op=hvd.Sum)
        results.append((float(x.min()), float(x.max()), float(y[0])))
    out = {"results": results, "x_seconds": x_times, **_counters(engine, before)}
    hvd.barrier()
    return out


def disagreeing_shapes(n: int = 3) -> dict:
    """The ranks call one name with different shapes (``n`` and ``n + 1`` elements, both
    on the express path): both fail alike and promptly, and the name works again after."""
    hvd.init()
    engine, r = _engine(), hvd.rank()
    before = (engine.express_rounds, engine.express_fallbacks)
    hvd.allreduce(np.zeros(1), name="warm")
    start = time.monotonic()
    try:
        hvd.allreduce(np.ones(n + r), name="bad", op=hvd.Sum)
        error = None
    except Exception as exc:  # noqa: BLE001 - the test checks what came back
        error = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    again = hvd.allreduce(np.full(3, r + 1.0), name="bad", op=hvd.Sum)
    out = {"error": error, "seconds": seconds, "again": again.tolist(),
           **_counters(engine, before)}
    hvd.barrier()
    return out


def express_loop_with_a_stalled_request(max_calls: int) -> dict:
    """Rank 1 submits an allgather rank 0 never does, then both loop on small synchronous
    allreduces (rank 0's on the express path) until rank 1's allgather has failed: rank 0
    must still time it out, as its usual cycle would."""
    hvd.init()
    engine, r = _engine(), hvd.rank()
    hvd.allreduce(np.zeros(1), name="warm")
    handle = hvd.allgather_async(np.zeros(3), name="only_rank1") if r == 1 else None
    start = time.monotonic()
    failed_after, calls = None, 0
    before = (engine.express_rounds, engine.express_fallbacks)
    while calls < max_calls:
        done = handle is not None and handle.done()
        if done and failed_after is None:
            failed_after = time.monotonic() - start
        calls += 1
        if hvd.allreduce(np.array([float(done)]), name="loop", op=hvd.Max)[0] > 0:
            break
    error = None
    if handle is not None:
        try:
            hvd.synchronize(handle)
        except Exception as exc:  # noqa: BLE001 - the test checks what came back
            error = f"{type(exc).__name__}: {exc}"
    return {"calls": calls, "failed_after": failed_after, "error": error,
            **_counters(engine, before)}
