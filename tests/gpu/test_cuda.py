"""CUDA paths: torch collectives and DistributedOptimizer on GPU tensors, and the
TorchEstimator's training loop with ``use_gpu``. Two ranks share GPU 0 (the engine
reduces on the CPU, so no NCCL is involved). Skipped where there is no GPU.

Needs torch, pyarrow and cloudpickle only (no pyspark): ``PYTHONPATH=. pytest tests/gpu``."""

from __future__ import annotations

import io

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from hvd_spark.data.spec import ColumnSpec, DatasetSpec, SplitSpec
from hvd_spark.data.store import Store
from hvd_spark.estimator.torch_worker import train_torch
from hvd_spark.estimator.train_spec import TrainSpec
from hvd_spark.runner.local.local_launcher import run_local

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here")


def _collectives_on_gpu() -> dict:
    import hvd_spark.torch as hvd

    hvd.init()
    r = hvd.rank()
    dev = torch.device("cuda", 0)
    out = {}
    y = hvd.allreduce(torch.full((1000,), float(r + 1), device=dev), op=hvd.Sum, name="sum")
    out["allreduce"] = (y.device.type, float(y.min()), float(y.max()))
    z = torch.arange(6, device=dev, dtype=torch.float32) * (r + 1)
    hvd.allreduce_(z, op=hvd.Average, name="avg_in_place")
    out["allreduce_"] = (z.device.type, z.cpu().tolist())
    g = hvd.allgather(torch.full((r + 1, 2), r, device=dev), name="gather")
    out["allgather"] = (g.device.type, g.cpu().tolist())
    b = torch.full((3,), float(r), device=dev)
    hvd.broadcast_(b, root_rank=1, name="bcast")
    out["broadcast_"] = (b.device.type, b.cpu().tolist())
    a, splits = hvd.alltoall(torch.arange(4, device=dev) + 10 * r, splits=[1, 3], name="a2a")
    out["alltoall"] = (a.device.type, a.cpu().tolist(), splits.tolist())
    rs = hvd.reducescatter(torch.ones(4, 3, device=dev) * (r + 1), op=hvd.Sum, name="rs")
    out["reducescatter"] = (rs.device.type, rs.cpu().tolist())
    grouped = hvd.grouped_allreduce([torch.ones(5, device=dev) * r, torch.ones(2, device=dev)],
                                    op=hvd.Sum, name="grouped")
    out["grouped"] = [(t.device.type, t.cpu().tolist()) for t in grouped]
    hvd.shutdown()
    return out


@needs_gpu
def test_collectives_on_cuda_tensors():
    rank0, rank1 = run_local(_collectives_on_gpu, num_proc=2)
    assert rank0["allreduce"] == rank1["allreduce"] == ("cuda", 3.0, 3.0)
    assert rank0["allreduce_"] == ("cuda", [0.0, 1.5, 3.0, 4.5, 6.0, 7.5])
    assert rank0["allgather"] == rank1["allgather"] == ("cuda", [[0, 0], [1, 1], [1, 1]])
    assert rank0["broadcast_"] == rank1["broadcast_"] == ("cuda", [1.0, 1.0, 1.0])
    assert rank0["alltoall"] == ("cuda", [0, 10], [1, 1])
    assert rank1["alltoall"] == ("cuda", [1, 2, 3, 11, 12, 13], [3, 3])
    assert rank0["reducescatter"] == rank1["reducescatter"] == ("cuda", [[3.0] * 3] * 2)
    assert rank0["grouped"] == [("cuda", [1.0] * 5), ("cuda", [2.0] * 2)]


def _train_on_gpu(distributed: bool, compression: str = "none", passes: int = 1,
                  device: str = "cuda") -> dict:
    import hvd_spark.torch as hvd

    dev = torch.device(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rows = slice(None)
    if distributed:
        hvd.init()
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(),
            compression=getattr(hvd.Compression, compression), backward_passes_per_step=passes)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        rows = slice(8 * hvd.rank(), 8 * (hvd.rank() + 1))
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(16, 16, 8, generator=g), torch.randn(16, 16, 4, generator=g)
    for i, (x, y) in enumerate(zip(xs, ys)):
        loss = ((model(x[rows].to(dev)) - y[rows].to(dev)) ** 2).mean()
        loss.backward()
        if (i + 1) % passes == 0:
            opt.step()
            opt.zero_grad()
    state = {k: v.cpu().numpy() for k, v in model.state_dict().items()}
    if distributed:
        hvd.shutdown()
    return state


@needs_gpu
@pytest.mark.parametrize("compression,passes", [("none", 1), ("fp16", 1), ("none", 2)])
def test_distributed_optimizer_on_gpu_matches_one_process(compression, passes):
    reference = _train_on_gpu(False, passes=passes)
    rank0, rank1 = run_local(_train_on_gpu, args=(True, compression, passes), num_proc=2)
    rtol, atol = (2e-2, 2e-3) if compression == "fp16" else (1e-4, 1e-5)
    for key, expected in reference.items():
        assert np.array_equal(rank0[key], rank1[key]), key
        np.testing.assert_allclose(rank0[key], expected, rtol=rtol, atol=atol, err_msg=key)
    assert not np.allclose(reference["0.weight"], _initial_weight())


def _initial_weight() -> np.ndarray:
    torch.manual_seed(0)
    return nn.Linear(8, 32).weight.detach().numpy()


def _dataset(root) -> DatasetSpec:
    rng = np.random.default_rng(0)
    files, counts = [], []
    w = rng.normal(size=(8, 3))
    for i in range(2):
        x = rng.normal(size=(256, 8)).astype(np.float32)
        y = np.argmax(x @ w, axis=1).astype(np.int64)
        (root / "train").mkdir(exist_ok=True)
        table = pa.table({"x": pa.array(list(x), pa.list_(pa.float32())), "y": y})
        pq.write_table(table, root / "train" / f"part-{i}.parquet")
        files.append(f"train/part-{i}.parquet")
        counts.append(256)
    return DatasetSpec(
        key="gpu-test", root_url=str(root),
        columns=(ColumnSpec("x", "float32", (8,), "array"), ColumnSpec("y", "int64")),
        feature_cols=("x",), label_cols=("y",),
        train=SplitSpec(tuple(files), sum(counts), tuple(counts)))


@needs_gpu
def test_torch_estimator_worker_trains_on_the_gpu(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    (tmp_path / "data").mkdir()
    spec = TrainSpec(
        dataset=_dataset(tmp_path / "data"), store=store, run_id="gpu", batch_size=32,
        val_batch_size=32, epochs=4, start_epoch=0, shuffle=True, seed=1, train_steps=None,
        val_steps=None, backward_passes_per_step=1, compression=None, verbose=1, use_gpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    payload = {
        "model_and_optimizer": cloudpickle.dumps((model, optimizer)),
        "loss": nn.CrossEntropyLoss(), "loss_constructors": None, "loss_weights": None,
        "metrics": [], "input_shapes": None, "train_minibatch_fn": None,
    }
    result, other = run_local(train_torch, args=(spec, payload), num_proc=2)
    assert other is None
    losses = [record["loss"] for record in result["history"]]
    assert len(losses) == 4 and losses[-1] < 0.6 * losses[0], losses
    # Rank 0's checkpoints hold the GPU tensors it trained; the returned model is on the CPU.
    epoch, blob = store.latest_checkpoint("gpu")
    state = torch.load(io.BytesIO(blob), weights_only=False)
    assert epoch == 3 and {t.device.type for t in state["model"].values()} == {"cuda"}
    trained = cloudpickle.loads(result["model"])["model"]
    assert {p.device.type for p in trained.parameters()} == {"cpu"}

