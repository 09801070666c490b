"""Two-rank jobs for small broadcasts and allgathers that the ranks decide alone
(``pairing``), synchronous ones on the express path (``tcp.express_moves``).

Each call's spec comes from ``plan``, shared with the test process, which builds the
references with ``reference``; each rank chooses per call, at random, whether it calls
synchronously (express) or asynchronously and waits (the usual path), so the two ranks
meet on every combination of paths.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np

import hvd_spark.collectives as hvd

DTYPES = ["float32", "float64", "int32", "int64", "uint8", "bool", "float16", "bfloat16"]
KINDS = ["broadcast", "broadcast_", "allgather"]


def plan(seed: int, thread: int, count: int) -> list[dict]:
    """The calls one thread makes on both ranks: kind, dtype, root, shape."""
    rng = random.Random(seed * 1000 + thread)
    specs = []
    for i in range(count):
        kind = KINDS[rng.randrange(len(KINDS))]
        specs.append({
            "name": f"t{thread}.{kind}.{i % 4}", "kind": kind,
            "dtype": DTYPES[rng.randrange(len(DTYPES))], "root": rng.randrange(2),
            # An allgather's first dim differs by rank; 0-d tensors now and then.
            "rows": [rng.randrange(4), rng.randrange(1, 4)],
            "trailing": rng.choice([(), (3,), (2, 5), (1000,)]),
        })
    return specs


def tensor(spec: dict, rank: int, step: int) -> np.ndarray:
    """Rank ``rank``'s input for ``spec`` at ``step`` (small integers: exact in every
    dtype)."""
    rows = spec["rows"][rank] if spec["kind"] == "allgather" else 2
    shape = (rows, *spec["trailing"])
    values = (np.arange(int(np.prod(shape))) + 7 * rank + step) % 50
    if spec["dtype"] == "bool":
        return (values % 2 == 0).reshape(shape)
    if spec["dtype"] == "bfloat16":
        import ml_dtypes

        return values.astype(ml_dtypes.bfloat16).reshape(shape)
    return values.astype(spec["dtype"]).reshape(shape)


def reference(spec: dict, step: int) -> np.ndarray:
    """What every rank must get for ``spec`` at ``step``."""
    if spec["kind"] == "allgather":
        return np.concatenate([tensor(spec, 0, step), tensor(spec, 1, step)])
    return tensor(spec, spec["root"], step)


def _call(spec: dict, rank: int, step: int, sync: bool) -> np.ndarray:
    x = tensor(spec, rank, step)
    kind, name = spec["kind"], spec["name"]
    if kind == "allgather":
        return (hvd.allgather(x, name=name) if sync
                else hvd.synchronize(hvd.allgather_async(x, name=name)))
    if kind == "broadcast":
        return (hvd.broadcast(x, spec["root"], name=name) if sync
                else hvd.synchronize(hvd.broadcast_async(x, spec["root"], name=name)))
    out = (hvd.broadcast_(x, spec["root"], name=name) if sync
           else hvd.synchronize(hvd.broadcast_async_(x, spec["root"], name=name)))
    if out is not x:
        raise AssertionError(f"{name}: broadcast_ returned another array than its own")
    return out


def move_rounds(seed: int, threads: int, count: int, slow_rank: int | None = None,
                delay_s: float = 0.0) -> dict:
    """Every thread makes its planned calls, each synchronously or not at random (per
    rank); ``slow_rank`` sleeps ``delay_s`` before each. Returns every result and the
    engine's express counters."""
    from hvd_spark.collectives import _plumbing

    hvd.init()
    try:
        rank = hvd.rank()
        engine = _plumbing.current_engine()
        results: list[list] = [[] for _ in range(threads)]

        def run(t: int) -> None:
            rng = random.Random(seed * 7919 + 31 * t + rank)
            for step, spec in enumerate(plan(seed, t, count)):
                if rank == slow_rank:
                    time.sleep(delay_s)
                try:
                    results[t].append(_call(spec, rank, step, rng.random() < 0.7))
                except Exception as exc:  # noqa: BLE001 - reported to the test
                    results[t].append(f"{type(exc).__name__}: {exc}")

        workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return {"results": results, "express": engine.express_rounds,
                "fallbacks": engine.express_fallbacks, "paired": engine.paired}
    finally:
        hvd.shutdown()


def disagreeing_moves() -> dict:
    """Calls the ranks disagree on (root, shape, an allgather's trailing dims, dtype),
    synchronously, each followed by one that agrees: both ranks must fail each alike
    and promptly, and go on."""
    hvd.init()
    try:
        r = hvd.rank()
        errors, seconds = [], []
        calls = [
            lambda: hvd.broadcast(np.zeros(3), r, name="root"),
            lambda: hvd.broadcast(np.zeros(3 + r), 0, name="shape"),
            lambda: hvd.allgather(np.zeros((2, 2 + r)), name="trailing"),
            lambda: hvd.allgather(np.zeros(2, np.float32 if r else np.float64), name="dtype"),
        ]
        after = []
        for call in calls:
            start = time.monotonic()
            try:
                call()
                errors.append(None)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                errors.append(str(exc))
            seconds.append(time.monotonic() - start)
            after.append(hvd.allgather(np.array([r]), name="after").tolist())
        return {"errors": errors, "seconds": seconds, "after": after}
    finally:
        hvd.shutdown()


def torch_moves(count: int) -> dict:
    """``hvd_spark.torch``'s synchronous broadcast, broadcast_ and allgather of CPU
    tensors (contiguous and not, bfloat16 too), and how many ran express."""
    import torch

    import hvd_spark.torch as ht
    from hvd_spark.collectives import _plumbing

    ht.init()
    try:
        r = ht.rank()
        engine = _plumbing.current_engine()
        before = engine.express_rounds
        out = []
        for i in range(count):
            base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 10 * r + i
            dtype = torch.bfloat16 if i % 3 == 2 else torch.float32
            t = base.to(dtype)
            b = ht.broadcast(t, i % 2, name="tb")
            c = t.clone()
            ht.broadcast_(c, 1, name="tb_")
            strided = t.clone().t()  # not contiguous: in place through the usual path
            ht.broadcast_(strided, 0, name="tbs")
            g = ht.allgather(t[: 1 + r], name="tg")
            out.append([x.float().tolist() for x in (b, c, strided, g)])
        return {"results": out, "express": engine.express_rounds - before}
    finally:
        ht.shutdown()


def sizes_across_the_eager_limit(rounds: int) -> dict:
    """Allgathers where one rank's tensor is above the eager size (it carries none, so
    the pair goes through rank 0) and broadcasts of 160 KB (inline on the express path,
    none on the usual path), each rank synchronous or not by turns: every result, and
    the express counters."""
    from hvd_spark.collectives import _plumbing

    hvd.init()
    try:
        r = hvd.rank()
        results = []
        for i in range(rounds):
            rows = 12_000 if r == i % 2 else 10  # 96 KB against 80 bytes
            mine = np.full((rows, 2), r, np.float32)
            sync = (i + r) % 3 != 0
            gathered = (hvd.allgather(mine, name="big") if sync
                        else hvd.synchronize(hvd.allgather_async(mine, name="big")))
            wide = np.full(40_000, r, np.float32)
            sent = (hvd.broadcast(wide, 1, name="wide") if sync
                    else hvd.synchronize(hvd.broadcast_async(wide, 1, name="wide")))
            results.append((gathered, sent))
        engine = _plumbing.current_engine()
        return {"results": results, "express": engine.express_rounds}
    finally:
        hvd.shutdown()
