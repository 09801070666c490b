"""Rank programs for grouped allreduces whose small tensors travel packed (``packing``)."""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np

import hvd_spark.collectives as hvd
from hvd_spark.collectives import _plumbing
from hvd_spark.errors import CollectiveError

BF16 = np.dtype(ml_dtypes.bfloat16)


def _group(seed: int, rank: int) -> list[np.ndarray]:
    """A mixed group: small float32 (packed), small float16 and int32 (not the most common
    dtype: alone), two float32 over the packing limit (on the packed request, uncopied), a
    0-d one and a strided view."""
    rng = np.random.default_rng(seed * 10 + rank)
    small = [rng.standard_normal(s).astype(np.float32) for s in [(3,), (4, 5), (1,), (17,)] * 3]
    return [*small, rng.standard_normal(40).astype(np.float16),
            rng.integers(-50, 50, 9).astype(np.int32),
            rng.standard_normal(20000).astype(np.float32),  # 80 KB
            np.asarray(rng.standard_normal(), np.float32),
            rng.standard_normal((30, 10)).astype(np.float32)[:, ::2],  # not contiguous
            rng.standard_normal(70000).astype(np.float32)]


def grouped_results(steps: int) -> dict:
    """Grouped allreduces, out of place and in place, several ops and scale factors; what
    each rank got, and how many tensors the engine ran (the packed ones count once)."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    engine = _plumbing.current_engine()
    out: dict = {"rank": r, "size": n, "runs": []}
    for step in range(steps):
        for op, pre, post in [(hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 0.5),
                              (hvd.Max, 1.0, 1.0), (hvd.Sum, 2.0, 1.0)]:
            inputs = _group(step, r)
            before = engine.executed_tensors
            got = hvd.grouped_allreduce(inputs, op=op, prescale_factor=pre, postscale_factor=post)
            ran = engine.executed_tensors - before
            # The packed ones' results own their memory: keeping one small result must not
            # keep the whole packed array alive.
            assert all(g.flags.owndata for g in got[:12]), [g.flags.owndata for g in got]
            mine = [a.copy() for a in inputs]
            same = hvd.grouped_allreduce_(mine, name=f"inplace.{step}", op=op,
                                          prescale_factor=pre, postscale_factor=post)
            assert all(x is y for x, y in zip(same, mine))
            untouched = all(a.tobytes() == b.tobytes() for a, b in zip(inputs, _group(step, r)))
            out["runs"].append({"op": int(op), "pre": pre, "post": post, "got": got,
                                "inplace": mine, "ran": ran, "untouched": untouched})
    # Bitwise agreement across ranks on the last results.
    raw = np.concatenate([np.frombuffer(g.tobytes(), np.uint8) for g in got])
    everyone = hvd.allgather(raw[None, :])
    out["agree"] = all((row == everyone[0]).all() for row in everyone)
    hvd.shutdown()
    return out


def _mismatched(r: int) -> list[list[np.ndarray]]:
    """Groups that differ between rank 0 and the others."""
    return [
        # A small tensor's shape differs (packed on every rank).
        [np.ones(3 if r == 0 else 4, np.float32), np.ones(5, np.float32)],
        # One rank's tensor is small (packed), the others' large (sent alone).
        [np.ones(10 if r == 0 else 30000, np.float32), np.ones(5, np.float32),
         np.ones(20000, np.float32)],
        # Another dtype: another set of tensors is packed on each side.
        [np.ones(3, np.float32 if r == 0 else np.float64), np.ones(5, np.float64),
         np.ones(6, np.float32)],
        # Equal layouts packed differently: a scalar is not packed, a 0-d array is.
        [np.float32(1.0), np.asarray(2.0, np.float32)] if r == 0 else
        [np.asarray(1.0, np.float32), np.float32(2.0)],
        # Another length: rank 0 has an extra tensor (its name, which no other rank has,
        # stays in flight there until the collective timeout: not reused below).
        [np.ones(2, np.float32), *([np.ones(3, np.float32)] if r == 0 else [])],
    ]


def mismatched_groups() -> dict:
    """Ranks that pass different groups: every rank fails at once with the layout error,
    whichever tensors each rank packed, and the same names work afterwards."""
    hvd.init()
    r = hvd.rank()
    out: dict = {"errors": [], "seconds": [], "after": []}
    for i, group in enumerate(_mismatched(r)):
        start = time.monotonic()
        try:
            hvd.grouped_allreduce(group, name=f"bad.{i}")
        except CollectiveError as exc:
            out["errors"].append(str(exc))
        else:
            out["errors"].append(None)
        out["seconds"].append(time.monotonic() - start)
        # The same names again, alike on every rank: nothing was left in flight.
        good = [np.ones(a.shape, np.float32) for a in _mismatched(0)[i]]
        again = f"bad.{i}" if i < 4 else f"fresh.{i}"
        results = hvd.grouped_allreduce(good, name=again, op=hvd.Sum)
        out["after"].append([float(x.reshape(-1)[0]) for x in results])
    hvd.shutdown()
    return out


def inplace_done_before_wait() -> dict:
    """An in-place grouped allreduce's arrays hold the results once its handles poll done,
    before anyone synchronizes (as for any in-place allreduce)."""
    hvd.init()
    r = hvd.rank()
    arrays = [np.full(4, r + 1.0, np.float32), np.full((2, 3), 10.0 * (r + 1), np.float32),
              np.full(50000, r + 1.0, np.float32)]  # two packed, one alone
    handles = hvd.grouped_allreduce_async_(arrays, name="polled", op=hvd.Sum)
    deadline = time.monotonic() + 30
    while not all(hvd.poll(h) for h in handles) and time.monotonic() < deadline:
        time.sleep(0.001)
    seen = [a.copy() for a in arrays]  # read before any synchronize
    results = [hvd.synchronize(h) for h in handles]
    same = all(x is y for x, y in zip(results, arrays))
    hvd.shutdown()
    return {"seen": seen, "same": same}



def refused_packed_reduction() -> dict:
    """A reduction refused for the packed dtype (bool Average) fails on every rank at
    once, naming the group's first packed tensor (not the internal packed key); the ranks
    go on. (The names stay in flight until every rank's report of the failure met: a
    local failure does not wait for that, so the next call takes another name.)"""
    hvd.init()
    r = hvd.rank()
    group = [np.ones(50000, np.float32), np.array([r == 0, True]), np.array([False])]
    start = time.monotonic()
    try:
        hvd.grouped_allreduce(group, name="flags")
        error = None
    except CollectiveError as exc:
        error = str(exc)
    seconds = time.monotonic() - start
    after = hvd.grouped_allreduce(group, name="flags.next", op=hvd.Max)
    # Nothing small to pack: an empty packed request, checked for nothing.
    large = hvd.grouped_allreduce([np.ones(50000, np.float32)] * 2, name="large", op=hvd.Sum)
    hvd.shutdown()
    return {"error": error, "seconds": seconds, "after": [a.tolist() for a in after[1:]],
            "large": [float(a.sum()) for a in large]}


class _Subclass(np.ndarray):
    """An ndarray subclass (as np.memmap is)."""


def uncopied_large_tensors() -> dict:
    """Large tensors of the packed dtype ride on the packed request (``packing.uncopied``):
    a non-contiguous one, a read-only one out of place, one of another dtype (alone),
    in place and out; a read-only one in place fails on every rank naming it; a rank
    that joined contributes zeros to a group it never called."""
    hvd.init()
    r = hvd.rank()
    engine = _plumbing.current_engine()
    base = np.arange(120000, dtype=np.float32).reshape(400, 300) * (r + 1)
    read_only = np.full(30000, r + 1.0, np.float32)
    read_only.flags.writeable = False
    group = [np.full(10, r + 1.0, np.float32), base[:, ::2], read_only,
             np.full(20000, r + 1.0)]  # 240 KB strided, 120 KB read-only, 160 KB float64
    before = engine.executed_tensors
    out = {"got": hvd.grouped_allreduce(group, name="out", op=hvd.Sum)}
    out["ran"] = engine.executed_tensors - before
    out["inputs_kept"] = (group[1].tobytes() == (np.arange(120000, dtype=np.float32)
                                                 .reshape(400, 300) * (r + 1))[:, ::2].tobytes())
    mine = [np.full(10, r + 1.0, np.float32), (np.arange(120000, dtype=np.float32)
                                               .reshape(400, 300) * (r + 1))[:, ::2],
            np.full((300, 100), r + 1.0, np.float32)]
    same = hvd.grouped_allreduce_(mine, name="in", op=hvd.Average)
    out["in_place"] = [a.copy() for a in mine]
    out["same"] = all(x is y for x, y in zip(same, mine))
    start = time.monotonic()
    try:
        hvd.grouped_allreduce_([np.ones(4, np.float32), read_only], name="ro", op=hvd.Sum)
        out["read_only_error"] = None
    except CollectiveError as exc:
        out["read_only_error"] = str(exc)
    out["read_only_seconds"] = time.monotonic() - start
    # An ndarray subclass on one rank, a plain array on the other: both ride uncopied.
    large = np.full(50000, r + 1.0, np.float32)
    subclassed = hvd.grouped_allreduce([np.ones(2, np.float32),
                                        large.view(_Subclass) if r == 0 else large],
                                       name="sub", op=hvd.Sum)
    out["subclass"] = [float(a.sum()) for a in subclassed]
    # The same dtypes and shapes, but a numpy scalar on one rank where the other passes an
    # array: packed on one rank only. Both fail at once, told why.
    start = time.monotonic()
    kinds = [np.float32(2.0) if r == 0 else np.array(2.0, np.float32), np.ones(3, np.float32)]
    try:
        hvd.grouped_allreduce(kinds, name="kinds", op=hvd.Sum)
        out["kinds_error"] = None
    except CollectiveError as exc:
        out["kinds_error"] = str(exc)
    out["kinds_seconds"] = time.monotonic() - start
    if r == 0:  # rank 1 joins at once: it contributes zeros

        alone = hvd.grouped_allreduce([np.full(3, 2.0, np.float32),
                                       np.full(50000, 5.0, np.float32)], name="j", op=hvd.Sum)
        out["alone"] = [a.tolist()[:3] + [float(a.sum())] for a in alone]
    out["last_joined"] = hvd.join()
    hvd.shutdown()
    return out
