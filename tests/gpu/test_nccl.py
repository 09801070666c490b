"""The device path on real GPUs: CUDA IPC between two ranks sharing one GPU, NCCL with
one rank per GPU (one rank where only one GPU exists; several where there are more),
the IPC+NCCL hierarchy, and the torch binding on it (no host copy).

Needs a CUDA GPU, torch with CUDA, and the gpu extra (cupy-cuda12x, nvidia-nccl-cu12):
a GPU machine without cupy fails these tests, it does not skip them. Skipped only where
there is no GPU. Run: ``PYTHONPATH=. pytest tests/gpu`` (or tests/gpu/run_device_checks.sh).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hvd_spark.runner.local.local_launcher import run_local

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                  reason="needs 2 GPUs (one rank per GPU)")


def _every_op(device_of_rank: str) -> dict:
    """Every device collective on cupy arrays; host copies of the results, and the path."""
    import cupy

    import hvd_spark.collectives as hvd
    from hvd_spark.collectives import _plumbing, device_ops, ops

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    device = {"own": hvd.local_rank(), "shared": 0}[device_of_rank]
    cupy.cuda.Device(device).use()
    torch.cuda.set_device(device)
    out = {}
    # Floats that sum exactly in any order, and values that differ per rank.
    x = cupy.arange(300_001, dtype=cupy.float32) * (r + 1) / 8
    h = device_ops.allreduce_many_async_([x], ["sum"], ops.Sum)
    h[0].wait()
    out["sum"] = cupy.asnumpy(x)
    fused = [cupy.full(1000 + i, float(r + i), cupy.float64) for i in range(5)]
    for hd in device_ops.allreduce_many_async_(fused, [f"f{i}" for i in range(5)], ops.Average):
        hd.wait()
    out["fused_avg"] = [cupy.asnumpy(f) for f in fused]
    for op in (ops.Min, ops.Max, ops.Product):
        v = cupy.full(7, r + 2, cupy.int32)
        device_ops.allreduce_many_async_([v], [f"op{int(op)}"], op)[0].wait()
        out[f"op{int(op)}"] = cupy.asnumpy(v)
    b = cupy.full(50_000, float(r), cupy.float32)
    device_ops.broadcast_async_(b, n - 1, "bcast").wait()
    out["bcast"] = cupy.asnumpy(b)
    g = device_ops.allgather_async(cupy.full((r + 1, 3), r, cupy.int64), "gather").wait()
    out["gather"] = cupy.asnumpy(g)
    rs = device_ops.reducescatter_async(cupy.ones((2 * n, 4), cupy.float32) * (r + 1), "rs",
                                        op=ops.Sum).wait()
    out["rs"] = cupy.asnumpy(rs)
    a2a, splits = device_ops.alltoall_async(cupy.arange(2 * n, dtype=cupy.int32) + 100 * r,
                                            name="a2a").wait()
    out["a2a"] = (cupy.asnumpy(a2a), np.asarray(splits))
    plan = _plumbing.current_engine().comm.plan
    out["mode"] = plan.mode if plan is not None else None
    hvd.shutdown()
    return out


def _check_every_op(results: list[dict], n: int) -> None:
    ref = sum(np.arange(300_001, dtype=np.float32) * (r + 1) / 8 for r in range(n))
    for res in results:
        np.testing.assert_array_equal(res["sum"], ref)
        for i, f in enumerate(res["fused_avg"]):
            np.testing.assert_allclose(f, np.mean([r + i for r in range(n)]))
        vals = [r + 2 for r in range(n)]
        assert (res[f"op{3}"] == min(vals)).all() and (res[f"op{4}"] == max(vals)).all()
        assert (res[f"op{5}"] == np.prod(vals)).all()
        assert (res["bcast"] == n - 1).all()
        assert res["gather"].shape == (n * (n + 1) // 2, 3)
        assert (res["rs"] == sum(range(1, n + 1))).all() and res["rs"].shape == (2, 4)
    for r, res in enumerate(results):
        got, splits = res["a2a"]
        assert splits.tolist() == [2] * n
        assert got[::2].tolist() == [100 * s + 2 * r for s in range(n)]
    # Bitwise equal on every rank.
    for res in results[1:]:
        assert res["sum"].tobytes() == results[0]["sum"].tobytes()


@needs_gpu
def test_two_ranks_sharing_one_gpu_go_through_cuda_ipc():
    results = run_local(_every_op, args=("shared",), num_proc=2)
    assert [r["mode"] for r in results] == ["ipc", "ipc"]
    _check_every_op(results, 2)


@needs_gpu
def test_one_rank_on_one_gpu_runs_nccl():
    (result,) = run_local(_every_op, args=("own",), num_proc=1)
    assert result["mode"] == "nccl"
    _check_every_op([result], 1)


@needs_2_gpus
def test_one_rank_per_gpu_runs_nccl():
    n = torch.cuda.device_count()
    results = run_local(_every_op, args=("own",), num_proc=n)
    assert {r["mode"] for r in results} == {"nccl"}
    _check_every_op(results, n)


def _two_per_gpu() -> dict:
    import cupy

    import hvd_spark.collectives as hvd
    from hvd_spark.collectives import _plumbing, device_ops, ops

    hvd.init()
    r = hvd.rank()
    cupy.cuda.Device(r % 2).use()
    x = cupy.full(1 << 20, float(r + 1), cupy.float32)
    device_ops.allreduce_many_async_([x], ["h"], ops.Sum)[0].wait()
    b = cupy.full(10, float(r), cupy.float32)
    device_ops.broadcast_async_(b, 3, "hb").wait()
    out = {"sum": float(x[0]), "bcast": float(b[0]),
           "mode": _plumbing.current_engine().comm.plan.mode}
    hvd.shutdown()
    return out


@needs_2_gpus
def test_two_ranks_per_gpu_on_two_gpus_is_hierarchical():
    results = run_local(_two_per_gpu, num_proc=4)
    assert {r["mode"] for r in results} == {"ipc+nccl"}
    assert {r["sum"] for r in results} == {10.0} and {r["bcast"] for r in results} == {3.0}


def _torch_on_device() -> dict:
    import hvd_spark.torch as hvd

    hvd.init()
    r = hvd.rank()
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(32, 16, device=dev, generator=torch.Generator(dev).manual_seed(r))
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    y = hvd.allreduce(torch.full((5,), float(r + 1), device=dev), op=hvd.Sum)
    z = torch.full((3,), float(r), device=dev)
    hvd.broadcast_(z, root_rank=1)
    g = hvd.allgather(torch.full((r + 1,), float(r), device=dev))
    out = {"weight": model.weight.detach().cpu().numpy(), "y": y.cpu().tolist(),
           "z": z.cpu().tolist(), "g": g.cpu().tolist(),
           "staged": opt._hvd_stager is not None, "y_device": y.device.type}
    hvd.shutdown()
    return out


@needs_gpu
def test_torch_binding_on_ipc_never_stages_through_the_host():
    rank0, rank1 = run_local(_torch_on_device, num_proc=2)
    for res in (rank0, rank1):
        assert res["staged"] is False  # DistributedOptimizer used the device path
        assert res["y"] == [3.0] * 5 and res["y_device"] == "cuda"
        assert res["z"] == [1.0] * 3 and res["g"] == [0.0, 1.0, 1.0]
    assert rank0["weight"].tobytes() == rank1["weight"].tobytes()


@needs_gpu
def test_device_fusion_buffer_on_the_gpu():
    import cupy

    from hvd_spark.collectives.nccl.fusion import FusionBuffer

    fusion = FusionBuffer(cupy)
    pieces = [cupy.arange(3, dtype=cupy.float32), cupy.arange(4, dtype=cupy.float32) + 10]
    flat = fusion.pack(pieces)
    flat *= 2
    fusion.unpack(flat, pieces)
    assert cupy.asnumpy(pieces[1]).tolist() == [20, 22, 24, 26]
