"""Rank programs for the MPI backend's tests, run under ``hvdrun --mpi`` (real mpirun ranks).

``python -m tests.integration.mpi_jobs CASE`` runs one case; each prints ``OK <case>`` when
its checks pass on that rank (an assertion error fails the rank and the job).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import hvd_spark.collectives as hvd
from hvd_spark.collectives import ops
from hvd_spark.errors import CollectiveError


def every_collective() -> None:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert hvd.backend_name() == "mpi"
    assert hvd.mpi_built() and hvd.mpi_enabled() and hvd.mpi_threads_supported()
    assert hvd.local_size() == n and hvd.local_rank() == r and hvd.cross_size() == 1
    total = n * (n + 1) / 2
    np.testing.assert_allclose(hvd.allreduce(np.full(7, r + 1.0), op=ops.Sum), total)
    np.testing.assert_allclose(hvd.allreduce(np.full(3, r + 1.0, np.float32)), total / n)
    half = hvd.allreduce(np.full(5, 0.5, ops.BFLOAT16), op=ops.Sum)
    assert half.dtype == ops.BFLOAT16 and float(half[0]) == 0.5 * n
    assert hvd.allreduce(np.array([r == 0, False]), op=ops.Max).tolist() == [True, False]
    gathered = hvd.allgather(np.full((r + 1, 2), r))
    assert gathered.shape == (n * (n + 1) // 2, 2) and gathered[-1, 0] == n - 1
    assert hvd.broadcast(np.array([r, r]), n - 1).tolist() == [n - 1, n - 1]
    got, splits = hvd.alltoall(np.arange(2 * n) + 100 * r)
    assert splits.tolist() == [2] * n and got[::2].tolist() == [100 * s + 2 * r for s in range(n)]
    mine = hvd.reducescatter(np.ones((2 * n, 3)) * (r + 1), op=ops.Sum)
    assert mine.shape == (2, 3) and (mine == total).all()
    assert hvd.broadcast_object({"from": r}, 0) == {"from": 0}
    assert hvd.allgather_object(r) == list(range(n))
    # Many tensors in flight at once: fused, and more requests than one negotiation slot holds.
    handles = [hvd.allreduce_async(np.full(10, float(i)), name=f"grad.{i:04d}." + "x" * 40,
                                   op=ops.Sum) for i in range(300)]
    for i, h in enumerate(handles):
        assert (hvd.synchronize(h) == i * n).all()
    evens = hvd.add_process_set([q for q in range(n) if q % 2 == 0])
    if r % 2 == 0:
        out = hvd.allreduce(np.array([1.0]), op=ops.Sum, process_set=evens)
        assert out[0] == len(evens.ranks)
    hvd.barrier()
    # Ranks that disagree get an error, not a hang.
    try:
        hvd.allreduce(np.ones(2 + r), name="mismatch")
    except CollectiveError as exc:
        assert "shape" in str(exc)
    else:
        raise AssertionError("shapes that differ must fail")
    if r == 0:  # join: the others contribute zeros to rank 0's last allreduce
        assert hvd.allreduce(np.array([5.0]), op=ops.Sum, name="last")[0] == 5.0
    assert hvd.join() in range(n)
    hvd.shutdown()
    print("OK every_collective", flush=True)


def rank_fails() -> None:
    hvd.init()
    if hvd.rank() == 1:
        raise RuntimeError("rank 1 breaks on purpose")
    hvd.allreduce(np.ones(4), name="never-completes")


def cached_rank_dies() -> None:
    """Rank 1 is killed while the ranks run cached small allreduces (the response cache's
    fast rounds): rank 0 must not wait for it until the collective timeout."""
    import signal

    from hvd_spark.collectives import _plumbing

    hvd.init()
    for _ in range(20):
        hvd.allreduce(np.ones(256, np.float32), name="warm", op=ops.Sum)
    assert _plumbing.current_engine().cached_rounds >= 10, _plumbing.current_engine().cached_rounds
    print(f"[cache warm on rank {hvd.rank()}]", flush=True)
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-step: rank 0 is in its next round
    for _ in range(1000):
        hvd.allreduce(np.ones(256, np.float32), name="warm", op=ops.Sum)
    raise AssertionError("rank 0 went on without rank 1")


def timeout() -> None:
    hvd.init()
    start = time.monotonic()
    try:
        hvd.allreduce(np.ones(4), name=f"only-on-{hvd.rank()}")
    except CollectiveError as exc:
        assert "did not submit it within" in str(exc), exc
        print(f"OK timeout after {time.monotonic() - start:.1f} s", flush=True)
    hvd.shutdown()


def early_shutdown() -> None:
    hvd.init()
    marker = os.environ["SHUTDOWN_MARKER"]  # rank 0 creates it once it has shut down
    if hvd.rank() == 0:
        hvd.shutdown()  # every rank's engine stops with it
        open(marker, "w").close()
        print("OK early_shutdown", flush=True)
        return
    deadline = time.monotonic() + 60
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.path.exists(marker), "rank 0 did not shut down within 60 s"
    try:
        for _ in range(1000):
            hvd.allreduce(np.ones(4))
            time.sleep(0.05)
    except CollectiveError as exc:
        assert "shutdown" in str(exc), exc
        print("OK early_shutdown", flush=True)
    hvd.shutdown()


def latency() -> None:
    hvd.init()
    x = np.ones(256, np.float32)
    for _ in range(100):
        hvd.allreduce(x)
    start = time.perf_counter()
    for _ in range(500):
        hvd.allreduce(x)
    print(f"OK latency {(time.perf_counter() - start) / 500 * 1e6:.0f} us", flush=True)
    hvd.shutdown()


def sub_communicators() -> None:
    """Horovod's init(comm=...): each half of the ranks forms its own job."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    sub = world.Split(color=world.Get_rank() % 2, key=world.Get_rank())
    hvd.init(comm=sub)
    assert hvd.size() == sub.Get_size() and hvd.rank() == sub.Get_rank()
    total = hvd.allreduce(np.array([world.Get_rank() + 1.0]), op=ops.Sum)[0]
    want = sum(r + 1.0 for r in range(world.Get_size()) if r % 2 == world.Get_rank() % 2)
    assert total == want, (total, want)
    hvd.shutdown()
    print(f"OK sub_communicators size {sub.Get_size()}", flush=True)


def autotune() -> None:
    """HVD_SPARK_AUTOTUNE under MPI: fusion and cycle time are tuned, the chunk is not
    (MPI cuts its own messages); results stay exact and equal on every rank."""
    import hashlib

    from tests.integration.collective_jobs import autotune_mid_run

    out = autotune_mid_run()
    assert out["done"] and out["worst_error"] < 1e-3, out
    assert out["engine"] == "MpiEngine" and set(out["chunks"]) == {None}
    if hvd.rank() == 0:
        assert "tuning fusion_threshold, cycle_time_ms from" in out["messages"][0], out
        assert "chunk_bytes" not in out["messages"][0].split(" from ")[0]
        print(f"CHOICE {out['choice']}", flush=True)
    digest = hashlib.sha256("".join(out["digests"]).encode()).hexdigest()[:16]
    hvd.shutdown()
    print(f"OK autotune {out['steps']} steps {digest}", flush=True)


def _reference(arrays: list[np.ndarray], op: ops.ReduceOp, postscale: float = 1.0) -> np.ndarray:
    """The coordinator's eager arithmetic on every rank's input: rank 0's, then each
    rank's folded in, in rank order, then finished."""
    out = arrays[0].copy()
    for a in arrays[1:]:
        ops.reduce_into(out, a, op)
    ops.finish_reduction(out, op, postscale, len(arrays))
    return out


def _same_bits_everywhere(result: np.ndarray) -> None:
    raw = np.frombuffer(result.tobytes(), np.uint8)
    everyone = hvd.allgather(raw[None, :])
    assert all((row == everyone[0]).all() for row in everyone), "ranks got different bits"


def _other_shape_fails(name: str) -> None:
    """Rank 0 asks for ``name`` with 255 elements, the others with 256: all must fail."""
    try:
        hvd.allreduce(np.ones(256 if hvd.rank() else 255, np.float32), name=name)
    except CollectiveError as exc:
        assert "shape" in str(exc), exc
    else:
        raise AssertionError("shapes that differ must fail")


def response_cache() -> None:
    """Small allreduces the ranks agreed on before: each rank reduces them itself (the
    MPI engine's response cache); results equal a numpy reference bit for bit."""
    from hvd_spark.collectives import _plumbing

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    engine = _plumbing.current_engine()
    inputs = lambda seed, shape, dtype: [  # noqa: E731 - every rank's input, known to all
        np.random.default_rng(seed * 100 + q).standard_normal(shape).astype(dtype)
        for q in range(n)]
    # Repeated unnamed 1 KB allreduces (the names change every call), then repeated named ones.
    for step in range(30):
        xs = inputs(step, 256, np.float32)
        got = hvd.allreduce(xs[r], op=ops.Sum)
        assert got.tobytes() == _reference(xs, ops.Sum).tobytes(), step
        mine = xs[r].copy()
        hvd.allreduce_(mine, name="grad.w", op=ops.Average)
        assert mine.tobytes() == _reference(xs, ops.Average).tobytes(), step
        _same_bits_everywhere(got)
    cached = engine.cached_rounds
    assert cached >= 40, cached
    # Other dtypes, ops and scale factors; the same name with a changed shape.
    for step, (dtype, op, shape) in enumerate([
            (np.float16, ops.Sum, (8, 4)), (np.float64, ops.Max, (3,)), (np.int32, ops.Sum, (5,)),
            (np.float32, ops.Average, (2, 3)), (np.float32, ops.Average, (7,))] * 3):
        xs = inputs(1000 + step, shape, dtype)
        got = hvd.allreduce(xs[r], name="changing", op=op, postscale_factor=0.5)
        assert got.shape == shape and got.dtype == dtype
        assert got.tobytes() == _reference(xs, op, 0.5).tobytes(), (step, dtype, op)
        _same_bits_everywhere(got)
    # A batch of several tensors, cached as one message.
    for step in range(5):
        xs = [inputs(2000 + 10 * step + i, 16 * (i + 1), np.float32) for i in range(4)]
        got = hvd.grouped_allreduce([x[r] for x in xs], op=ops.Sum)
        for i, x in enumerate(xs):
            assert got[i].tobytes() == _reference(x, ops.Sum).tobytes(), (step, i)
    assert engine.cached_rounds > cached
    # Larger tensors (no ride along): a lone one skips rank 0, several go to it (fused).
    before = engine.cached_rounds
    for step in range(5):
        xs = inputs(5000 + step, 2048, np.float32)
        got = hvd.allreduce(xs[r], op=ops.Sum)
        np.testing.assert_allclose(got, _reference(xs, ops.Sum), rtol=1e-5, atol=1e-5)
        _same_bits_everywhere(got)
        many = [inputs(6000 + 10 * step + i, 1024 * (i + 1), np.float32) for i in range(3)]
        outs = hvd.grouped_allreduce([x[r] for x in many], op=ops.Average)
        for out, x in zip(outs, many):
            np.testing.assert_allclose(out, _reference(x, ops.Average), rtol=1e-5, atol=1e-5)
            _same_bits_everywhere(out)
    assert engine.cached_rounds >= before + 4, (before, engine.cached_rounds)
    # Ranks that submit in different orders still agree (rank 0 sorts it out).
    for step in range(5):
        xs = {k: inputs(3000 + 10 * step + i, 64, np.float32) for i, k in enumerate("ab")}
        order = "ab" if r % 2 == 0 else "ba"
        handles = {k: hvd.allreduce_async(xs[k][r], name=f"order.{k}", op=ops.Sum)
                   for k in order}
        for k in "ab":
            assert hvd.synchronize(handles[k]).tobytes() == _reference(xs[k], ops.Sum).tobytes()
    # A rank that asks for a cached name with another shape: every rank gets the error.
    before = engine.cached_rounds
    _other_shape_fails("grad.w")
    assert engine.cached_rounds == before
    # ... and the cache works on afterwards.
    xs = inputs(4000, 256, np.float32)
    mine = xs[r].copy()
    hvd.allreduce_(mine, name="grad.w", op=ops.Average)
    assert mine.tobytes() == _reference(xs, ops.Average).tobytes()
    assert engine.cached_rounds == before + 1
    hvd.shutdown()
    print(f"OK response_cache {cached}", flush=True)


def express() -> None:
    """Synchronous small allreduces the ranks agreed on before run in one round with no
    entry (``MpiEngine.express_allreduce``), with the bits of the usual path; when a rank
    is elsewhere (async work pending, a timeline on rank 0, another shape), the call goes
    on as a usual submission and still completes right."""
    from hvd_spark.collectives import _plumbing

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    engine = _plumbing.current_engine()
    inputs = lambda seed, shape, dtype: [  # noqa: E731 - every rank's input, known to all
        np.asarray(np.random.default_rng(seed * 100 + q).standard_normal(shape) * 4).astype(dtype)
        for q in range(n)]
    cases = [(np.float32, ops.Average, (256,), 1.0), (np.float16, ops.Sum, (8, 4), 1.0),
             (ops.BFLOAT16, ops.Average, (33,), 0.5), (np.float64, ops.Max, (3,), 1.0),
             (np.int32, ops.Sum, (5,), 1.0), (np.int64, ops.Average, (6,), 1.0),
             (np.float32, ops.Min, (), 1.0), (np.float32, ops.Product, (4,), 2.0),
             # Too large to ride along: the backend reduces it after the round.
             (np.float32, ops.Average, (2048,), 1.0), (ops.BFLOAT16, ops.Sum, (3000,), 0.25)]
    for step in range(6):
        for i, (dtype, op, shape, post) in enumerate(cases):
            xs = inputs(100 * step + i, shape, dtype)
            want = _reference(xs, op, post).tobytes()
            got = hvd.allreduce(xs[r], name=f"case.{i}", op=op, postscale_factor=post)
            assert got.shape == shape and got.dtype == dtype, (step, i)
            if xs[r].nbytes > engine.eager_bytes:  # MPI's own sum order: same bits everywhere
                want = got.tobytes()
                _same_bits_everywhere(got)
                np.testing.assert_allclose(got.astype(np.float64), _reference(xs, op, post)
                                           .astype(np.float64), rtol=2e-2, atol=1e-3)
            assert got.tobytes() == want, (step, i)
            assert got is not xs[r] and xs[r].tobytes() == inputs(100 * step + i, shape,
                                                                  dtype)[r].tobytes()
            mine = xs[r].copy()
            assert hvd.allreduce_(mine, name=f"case.{i}", op=op, postscale_factor=post) is mine
            assert mine.tobytes() == want, (step, i)
            # Unnamed: the automatic names stay aligned whichever path each rank takes.
            if r == 1:
                got = hvd.synchronize(hvd.allreduce_async(xs[r], op=op, postscale_factor=post))
            else:
                got = hvd.allreduce(xs[r], op=op, postscale_factor=post)
            assert got.tobytes() == want, (step, i)
    _same_bits_everywhere(got)
    assert engine.express_rounds >= 4 * len(cases), engine.express_rounds
    # Async work pending on rank 0 only: rank 0 submits as usual, the others' express
    # round meets a different message and goes on as usual.
    fallbacks = engine.express_fallbacks
    for step in range(4):
        xs, side = inputs(900 + step, (256,), np.float32), inputs(950 + step, (7,), np.float32)
        handle = hvd.allreduce_async(side[r], name="side", op=ops.Sum) if r == 0 else None
        got = hvd.allreduce(xs[r], name="case.0")
        assert got.tobytes() == _reference(xs, ops.Average).tobytes(), step
        if r != 0:
            handle = hvd.allreduce_async(side[r], name="side", op=ops.Sum)
        assert hvd.synchronize(handle).tobytes() == _reference(side, ops.Sum).tobytes()
    if r != 0:
        assert engine.express_fallbacks > fallbacks, (fallbacks, engine.express_fallbacks)
    # A timeline on rank 0 (rank 0 must see every request): usual rounds, same bits.
    if r == 0:
        hvd.start_timeline(os.environ["EXPRESS_TIMELINE"])
    hvd.barrier()
    before = engine.express_rounds
    for step in range(5):
        xs = inputs(1200 + step, (256,), np.float32)
        assert hvd.allreduce(xs[r], name="case.0").tobytes() == _reference(
            xs, ops.Average).tobytes()
    assert engine.express_rounds == before, (before, engine.express_rounds)
    if r == 0:
        hvd.stop_timeline()
    hvd.barrier()
    for step in range(20):  # a busy host can make a few calls in a row go the usual way
        xs = inputs(1300 + step, (256,), np.float32)
        assert hvd.allreduce(xs[r], name="case.0").tobytes() == _reference(
            xs, ops.Average).tobytes()
    assert engine.express_rounds > before
    # Another shape under a known name on one rank: every rank gets the error.
    _other_shape_fails("case.0")
    xs = inputs(1400, (256,), np.float32)
    assert hvd.allreduce(xs[r], name="case.0").tobytes() == _reference(xs, ops.Average).tobytes()
    # A byte-swapped float32 is also named 'float32': not the express round's known
    # allreduce, but the usual check's clear error on every rank (large and small).
    for count in (256, 4096):
        try:
            hvd.allreduce(np.ones(count, ">f4"), name="case.0")
        except CollectiveError as exc:
            assert "dtype" in str(exc), exc
        else:
            raise AssertionError("a byte-swapped array was reduced")
    hvd.shutdown()
    print(f"OK express {engine.express_rounds} {engine.express_fallbacks}", flush=True)


#: How long rank 1 of ``slow_import`` takes before it calls init(): longer than the
#: start timeout its test sets (5 s), as importing torch or TensorFlow can be.
SLOW_IMPORT_S = 8.0


def slow_import() -> None:
    """Rank 1 reaches init() ``SLOW_IMPORT_S`` late; every rank says how long its init()
    waited for the others.

    MPI is initialised first, as in a script that imports mpi4py at its top: otherwise
    MPI_Init itself (in init()) would wait for the late rank, with no deadline of ours.
    """
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    if rank == 1:
        time.sleep(SLOW_IMPORT_S)  # its imports, on a slow machine
    start = time.monotonic()
    hvd.init()
    waited = time.monotonic() - start
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=ops.Sum)
    assert total[0] == 3.0, total
    hvd.shutdown()
    print(f"OK slow_import init waited {waited:.1f} s", flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]]()
