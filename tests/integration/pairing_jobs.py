"""Randomized two-rank jobs for the pairing path (``hvd_spark.collectives.pairing``).

The workers import these functions. Whatever the ranks must agree on (names, shapes,
dtypes, ops, the order of steps) comes from a ``random.Random`` seeded alike on both
ranks (``plan_*``); timing (sleeps, submission and wait orders) comes from one seeded
per rank, so the ranks race each other differently on every run. The test process
calls the same ``plan_*`` and ``tensor`` functions to build its numpy references.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import hvd_spark.collectives as hvd

# Small ops with exact results (integer-valued inputs, power-of-two scales), so numpy
# and the engine agree to the bit.
OPS = ("Sum", "Average", "Min", "Max", "Product")
DTYPES = ("float64", "float32", "int32", "int64")
# The eager limit the tests set (HVD_SPARK_EAGER_BYTES): past 64 KB a tensor travels
# beside its request's pickle (``wire.encode_obj``), so both framings are exercised.
EAGER_BYTES = 128 * 1024


def tensor(spec: dict, rank: int, step: int) -> np.ndarray:
    """Rank ``rank``'s input for ``spec`` at ``step``: small integers, rank-dependent."""
    n = spec["n"]
    base = (np.arange(n) % 5) + 1 + 2 * rank + (step % 3)
    return base.astype(spec["dtype"]).reshape(spec.get("shape", (n,)))


def reference(spec: dict, step: int) -> np.ndarray:
    """What a two-rank allreduce of ``spec`` at ``step`` must return (numpy)."""
    x0, x1 = (tensor(spec, r, step) for r in (0, 1))
    dtype = x0.dtype
    pre, post = spec["prescale"], spec["postscale"]
    if pre != 1.0:
        x0, x1 = (x * dtype.type(pre) for x in (x0, x1))
    op = spec["op"]
    if op in ("Sum", "Average"):
        out = x0 + x1
        if op == "Average":
            out = (out / 2).astype(dtype) if dtype.kind == "f" else out // 2
    elif op == "Min":
        out = np.minimum(x0, x1)
    elif op == "Max":
        out = np.maximum(x0, x1)
    else:
        out = x0 * x1
    if post != 1.0:
        out = out * dtype.type(post)
    return out.astype(dtype)


def random_spec(rng: random.Random, name: str) -> dict:
    """One allreduce: mostly pairable (small), sometimes right at or past the limit."""
    dtype = rng.choice(DTYPES)
    itemsize = np.dtype(dtype).itemsize
    limit = EAGER_BYTES // itemsize
    n = rng.choice([1, 2, 3, 7, 16, 100, rng.randint(1, 2000), limit, limit + 1])
    op = rng.choice(OPS if dtype.startswith("float") else ("Sum", "Min", "Max"))
    floats = dtype.startswith("float")
    return {
        "name": name, "n": n, "dtype": dtype, "op": op,
        "prescale": rng.choice([1.0, 1.0, 0.5]) if floats and op != "Product" else 1.0,
        "postscale": rng.choice([1.0, 1.0, 2.0]) if floats and op != "Product" else 1.0,
        "inplace": rng.random() < 0.5,
    }


def plan_threads(seed: int, threads: int, steps: int) -> list[list[list[dict]]]:
    """Per thread, per step: the batch of allreduces it submits at once (same names
    every few steps; distinct names within a batch)."""
    rng = random.Random(seed)
    out = []
    for t in range(threads):
        per_step = []
        for _ in range(steps):
            ks = rng.sample(range(4), rng.choice([1, 1, 2, 3]))
            per_step.append([random_spec(rng, f"t{t}.k{k}") for k in ks])
        out.append(per_step)
    return out


def _submit(spec: dict, rank: int, step: int):
    """Start ``spec``'s allreduce; returns (handle, the in-place array or None)."""
    x = tensor(spec, rank, step)
    kwargs = {"name": spec["name"], "op": getattr(hvd, spec["op"]),
              "prescale_factor": spec["prescale"], "postscale_factor": spec["postscale"]}
    if spec["inplace"]:
        return hvd.allreduce_async_(x, **kwargs), x
    return hvd.allreduce_async(x, **kwargs), None


def threaded_steps(seed: int, threads: int, steps: int, slow_rank: int | None = None,
                   timeline_path: str | None = None) -> dict:
    """``threads`` threads per rank submit small allreduce batches at once, each batch
    waited in a per-rank random order, with per-rank jitter (``slow_rank`` sometimes
    sleeps tens of ms). With ``timeline_path``, thread 0 starts and stops a timeline
    every few steps, so pairing closes and reopens while the others submit.

    Returns:
        {"results": per thread, per step, the results in batch order (or the error
        text), "paired": allreduces decided by the two ranks alone}
    """
    from hvd_spark.collectives import _plumbing

    hvd.init()
    r = hvd.rank()
    engine = _plumbing.current_engine()
    plan = plan_threads(seed, threads, steps)
    results: dict[int, list] = {}
    before = engine.paired

    def worker(t: int) -> None:
        jitter = random.Random(seed * 7919 + 31 * r + t)  # differs per rank: timing only
        mine = []
        for step, batch in enumerate(plan[t]):
            if timeline_path is not None and t == 0 and step % 5 == 0:
                if (step // 5) % 2 == 0:
                    hvd.start_timeline(timeline_path)
                else:
                    hvd.stop_timeline()
            p = jitter.random()
            if p < 0.2:
                time.sleep(jitter.random() * 0.002)
            elif p < 0.25 and r == slow_rank:
                time.sleep(0.01 + jitter.random() * 0.03)
            out: list = [None] * len(batch)
            try:
                started = [_submit(spec, r, step) for spec in batch]
            except Exception as exc:  # noqa: BLE001 - the test reports it
                mine.append([f"submit: {type(exc).__name__}: {exc}"] * len(batch))
                continue
            for i in jitter.sample(range(len(batch)), len(batch)):
                handle, inplace = started[i]
                try:
                    value = hvd.synchronize(handle)
                    out[i] = inplace if inplace is not None else value
                except Exception as exc:  # noqa: BLE001 - the test reports it
                    out[i] = f"{type(exc).__name__}: {exc} (at {time.monotonic():.3f})"
            mine.append(out)
        results[t] = mine

    pool = [threading.Thread(target=worker, args=(t,), name=f"user{t}") for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(120)
    if timeline_path is not None:
        hvd.stop_timeline()
    paired = engine.paired - before
    hvd.shutdown()
    return {"results": [results.get(t) for t in range(threads)], "paired": paired}


def plan_mixed(seed: int, rounds: int) -> list[dict]:
    """Per round: a mismatch for one name (which rank differs, how, who arrives first)."""
    rng = random.Random(seed)
    return [{"name": f"mix.{i % 3}", "how": rng.choice(["size", "dtype", "op", "shape"]),
             "odd": rng.randint(0, 1), "late": rng.randint(0, 1),
             "inplace": rng.random() < 0.5} for i in range(rounds)]


def first_then(r: int, first: int, call: Callable[[bool], Any]) -> Any:
    """Run ``call`` on both ranks, rank ``first``'s request in before the other's call
    starts: rank ``first`` submits it asynchronously, a barrier follows (its request
    left before the barrier's, on the same socket, or is queued on rank 0 before it),
    and only then does the other rank call (synchronously: the express path may take
    it, with the first rank's request read already).

    Args:
        r: This rank.
        first: The rank whose request comes first.
        call: ``fn(asynchronous)``: the collective, started asynchronously (returning
            its handle) or run synchronously (returning its result).
    """
    if r == first:
        handle = call(True)
        hvd.barrier()
        return hvd.synchronize(handle)
    hvd.barrier()
    return call(False)


def mismatched_then_good(seed: int, rounds: int) -> dict:
    """Each round one name is submitted with a mismatch (one rank's tensor pairable and
    the other's not, or both pairable but different), the rank named ``late`` asking
    second (``first_then``) so either request arrives first; then the same name runs
    correctly, the other rank asking first. The error must reach both ranks promptly,
    and the good run after it must be exact.

    Returns:
        {"errors": per round (error text or "no error", seconds), "good": per round
        the good result}
    """
    hvd.init()
    r = hvd.rank()
    limit = EAGER_BYTES // 8
    errors, good = [], []
    for i, rnd in enumerate(plan_mixed(seed, rounds)):
        name, odd = rnd["name"], r == rnd["odd"]
        x = np.ones(4)
        op = hvd.Sum
        if rnd["how"] == "size":  # the odd rank's tensor does not ride on its request
            x = np.ones(limit + 1 if odd else 4)
        elif rnd["how"] == "dtype":
            x = np.ones(4, np.float32 if odd else np.float64)
        elif rnd["how"] == "op":
            op = hvd.Max if odd else hvd.Sum
        else:
            x = np.ones((2, 2) if odd else (4,))
        def mismatched(asynchronous, x=x, name=name, op=op):
            run = hvd.allreduce_async if asynchronous else hvd.allreduce
            return run(x, name=name, op=op)

        start = time.monotonic()
        try:
            first_then(r, 1 - rnd["late"], mismatched)
            errors.append(("no error", time.monotonic() - start))
        except Exception as exc:  # noqa: BLE001 - the test compares the messages
            errors.append((f"{type(exc).__name__}: {exc}", time.monotonic() - start))
        spec = {"name": name, "n": 5, "dtype": "float64", "op": "Sum", "prescale": 1.0,
                "postscale": 1.0, "inplace": rnd["inplace"]}
        # The late rank's request is in first this time.
        if r == rnd["late"]:
            handle, inplace = _submit(spec, r, i)
            hvd.barrier()
        else:
            hvd.barrier()
            handle, inplace = _submit(spec, r, i)
        value = hvd.synchronize(handle)
        good.append(inplace if inplace is not None else value)
    hvd.shutdown()
    return {"errors": errors, "good": good}


def early_join(seed: int, rounds: int, per_round: int) -> dict:
    """Each round one rank (shared choice) joins at once while the other still runs
    ``per_round`` small allreduces (names reused, some async pairs); then both run the
    same names again. A joined rank contributes zeros, so the worker's sums are its own.

    Returns:
        {"alone": per round the lone rank's results ([] on the joiner), "last": join()'s
        answers, "together": per round the results after the join}
    """
    hvd.init()
    r = hvd.rank()
    plan = random.Random(seed)
    jitter = random.Random(seed + 1 + r)
    alone, last, together = [], [], []
    for rnd in range(rounds):
        joiner = plan.randint(0, 1)
        names = [f"j.{k}" for k in range(3)]
        mine = []
        if r == joiner:
            time.sleep(jitter.random() * 0.01)
        else:
            for i in range(per_round):
                if i % 4 == 3:  # two at once, waited in reverse
                    hs = [hvd.allreduce_async(np.full(3, 10.0 * rnd + i + k), name=names[k],
                                              op=hvd.Sum) for k in (0, 1)]
                    mine.extend(hvd.synchronize(h).tolist() for h in hs[::-1])
                else:
                    mine.append(hvd.allreduce(np.full(3, 10.0 * rnd + i), name=names[i % 3],
                                              op=hvd.Sum).tolist())
        alone.append(mine)
        last.append(hvd.join())
        row = []
        for i in range(per_round):
            if jitter.random() < 0.3:
                time.sleep(jitter.random() * 0.005)
            row.append(hvd.allreduce(np.full(2, 100.0 * rnd + i + r), name=names[i % 3],
                                     op=hvd.Sum).tolist())
        together.append(row)
    hvd.shutdown()
    return {"alone": alone, "last": last, "together": together}


def process_sets_mixed(seed: int, steps: int) -> dict:
    """Global allreduces (pairable) interleaved with process-set ones (never paired):
    each rank alone in its own set; submitted in a
    per-rank random order, waited in another.

    Returns:
        {"steps": per step {name: result}, "paired": allreduces decided alone}
    """
    from hvd_spark.collectives import _plumbing

    hvd.init()
    r = hvd.rank()
    engine = _plumbing.current_engine()
    sets = [hvd.add_process_set([0]), hvd.add_process_set([1])]
    jitter = random.Random(seed * 31 + r)
    before = engine.paired
    steps_out = []
    for step in range(steps):
        ops = [(f"g.{k}", None) for k in range(3)] + [(f"solo{r}", sets[r])]
        jitter.shuffle(ops)
        handles = {}
        for name, pset in ops:
            x = np.full(4, 1.0 + step + 2 * r)
            if pset is None:
                handles[name] = hvd.allreduce_async(x, name=name, op=hvd.Sum)
            else:
                handles[name] = hvd.allreduce_async(x, name=name, op=hvd.Sum, process_set=pset)
            if jitter.random() < 0.2:
                time.sleep(jitter.random() * 0.003)
        order = list(handles)
        jitter.shuffle(order)
        steps_out.append({name: hvd.synchronize(handles[name]).tolist() for name in order})
    paired = engine.paired - before
    hvd.shutdown()
    return {"steps": steps_out, "paired": paired}


def opposite_orders_and_late_halves(steps: int = 30) -> dict:
    """The same three small allreduces every step, submitted in opposite orders on the
    ranks (each must pair); a pairable and an unpairable half of one name; then a lone
    allreduce whose half comes late from rank 1, then from rank 0, after a barrier (the
    early half waits for it and still pairs; ``first_then``).

    Returns:
        {"steps": per step the three results, "paired": pairs decided in the steps,
        "mixed": (error text, seconds) per mixed case, "late1", "late0": the late
        allreduces' results, "paired_late": their pairs}
    """
    from hvd_spark.collectives import _plumbing

    hvd.init()
    r = hvd.rank()
    engine = _plumbing.current_engine()
    names = ["loss", "acc", "count"]
    before = engine.paired
    out: dict = {"steps": []}
    for step in range(steps):
        order = names if (r + step) % 2 == 0 else names[::-1]
        handles = {nm: hvd.allreduce_async(np.array([step * 10.0 + names.index(nm) + r]),
                                           name=nm, op=hvd.Sum) for nm in order}
        out["steps"].append([float(hvd.synchronize(handles[nm])[0]) for nm in names])
    out["paired"] = engine.paired - before
    # One rank's tensor rides along, the other's is too large to even alone: both fail
    # alike; then rank 1's unpairable request reaches rank 0 first (rank 0 must not pair
    # its own).
    limit_rows = engine.lone_eager_bytes // 8
    for small, late in ((0, None), (1, None), (0, 0)):
        rows = 2 if r == small else limit_rows + 1

        def mixed(asynchronous, rows=rows, name=f"mixed{small}.{late}"):
            return (hvd.allreduce_async if asynchronous else hvd.allreduce)(
                np.ones(rows), name=name)

        start = time.monotonic()
        try:
            if late is None:
                mixed(False)
            else:
                first_then(r, 1 - late, mixed)
            text = "no error"
        except Exception as exc:  # noqa: BLE001 - the test compares the messages
            text = f"{type(exc).__name__}: {exc}"
        out.setdefault("mixed", []).append((text, time.monotonic() - start))
    before = engine.paired
    out["warm"] = hvd.allreduce(np.ones(2) * (r + 1), op=hvd.Sum).tolist()
    # Rank 0's request waits for rank 1's; then rank 0 holds rank 1's until it asks too.
    for name, value, first in (("late1", r + 1.0, 0), ("late0", r + 2.0, 1)):
        def late(asynchronous, name=name, value=value):
            run = hvd.allreduce_async if asynchronous else hvd.allreduce
            return run(np.array([value]), name=name, op=hvd.Sum)

        out[name] = first_then(r, first, late).tolist()
    out["paired_late"] = engine.paired - before
    hvd.shutdown()
    return out
