"""hvd_spark's Lightning strategy on two real processes (run_local, no Spark): the ranks see
different data, yet end with identical weights equal to training on the averaged gradients,
and Lightning's collectives (reduce, broadcast, all_gather, barrier) go through hvd_spark."""

from __future__ import annotations

import lightning  # noqa: F401 - CI installs it: never a skip

from hvd_spark.runner.local.local_launcher import run_local


def _train(accumulate: int) -> dict:
    import lightning.pytorch as pl
    import torch

    import hvd_spark.torch as hvd
    from hvd_spark.estimator.lightning_strategy import strategy_class

    hvd.init()
    torch.manual_seed(0)  # the same start on both ranks (rank 0's is broadcast anyway)

    class Linear(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 1, bias=False)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    gen = torch.Generator().manual_seed(10 + hvd.rank())  # different data on each rank
    x = torch.randn(8, 3, generator=gen)
    y = torch.randn(8, 1, generator=gen)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    model = Linear()
    strategy = strategy_class(pl)()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False,
                         accumulate_grad_batches=accumulate)
    trainer.fit(model, loader)
    rank_tensor = torch.tensor([float(hvd.rank())])
    return {
        "rank": trainer.global_rank, "world": trainer.world_size,
        "weights": model.layer.weight.detach().reshape(-1).tolist(),
        "x": x.tolist(), "y": y.tolist(),
        "sum": float(strategy.reduce(rank_tensor + 1, reduce_op="sum")),
        "mean": float(strategy.reduce(rank_tensor)),
        "gathered": strategy.all_gather(rank_tensor).reshape(-1).tolist(),
        "broadcast": strategy.broadcast(f"from rank {hvd.rank()}", src=1),
    }


def _reference(results: list[dict], accumulate: int) -> list[float]:
    """Single-process SGD on the gradients averaged over the two ranks' batches."""
    import torch

    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 1, bias=False)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    xs = [torch.tensor(r["x"]) for r in results]
    ys = [torch.tensor(r["y"]) for r in results]
    for start in range(0, 8, 4 * accumulate):
        opt.zero_grad()
        for step in range(start, start + 4 * accumulate, 4):
            for x, y in zip(xs, ys):
                loss = torch.nn.functional.mse_loss(layer(x[step:step + 4]), y[step:step + 4])
                (loss / (len(xs) * accumulate)).backward()
        opt.step()
    return layer.weight.detach().reshape(-1).tolist()


def test_lightning_strategy_averages_gradients_over_ranks():
    for accumulate in (1, 2):
        results = run_local(_train, args=(accumulate,), num_proc=2,
                            env={"HVD_SPARK_TIMEOUT": "120"})
        assert [r["rank"] for r in results] == [0, 1] and results[0]["world"] == 2
        assert results[0]["weights"] == results[1]["weights"], "ranks must stay in sync"
        expected = _reference(results, accumulate)
        assert all(abs(a - b) < 1e-5 for a, b in zip(results[0]["weights"], expected)), (
            accumulate, results[0]["weights"], expected)
        for r in results:
            assert r["sum"] == 3.0 and r["mean"] == 0.5 and r["gathered"] == [0.0, 1.0]
            assert r["broadcast"] == "from rank 1"
