"""Rank programs for the MPI backend's tests, run under ``hvdrun --mpi`` (real mpirun ranks).

``python -m tests.integration.mpi_jobs CASE`` runs one case; each prints ``OK <case>`` when
its checks pass on that rank (an assertion error fails the rank and the job).
"""

from __future__ import annotations

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
    if hvd.rank() == 0:
        hvd.shutdown()  # every rank's engine stops with it
        print("OK early_shutdown", flush=True)
        return
    time.sleep(1.0)
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


if __name__ == "__main__":
    globals()[sys.argv[1]]()
