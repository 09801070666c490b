"""The Hugging Face ``Trainer``, an ``accelerate`` loop and Lightning's ``ddp`` strategy on
our ranks, unchanged: each recognises the torchrun job from the environment we give."""

from __future__ import annotations

import json
from pathlib import Path

import accelerate  # noqa: F401 - CI installs it: never a skip
import lightning  # noqa: F401 - CI installs it: never a skip
import pyspark  # noqa: F401 - CI installs it: never a skip
import torch
import transformers  # noqa: F401 - CI installs it: never a skip

from hvd_spark import TorchDistributor
from hvd_spark.runner.local.local_launcher import run_local

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _losses(output: Path) -> dict:
    report = json.loads((output / "losses.json").read_text())
    first, last = report["losses"][0], report["losses"][-1]
    assert last < 0.7 * first, f"loss did not fall: {report['losses']}"
    return report


def test_hugging_face_trainer_script_on_barrier_tasks(spark, tmp_path) -> None:
    from transformers import BertForSequenceClassification

    TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        str(SCRIPTS / "hf_trainer.py"), "--output", str(tmp_path))
    assert _losses(tmp_path)["world"] == 2
    model = BertForSequenceClassification.from_pretrained(tmp_path / "model")
    ids = torch.tensor([[60, 70, 80, 90] * 4, [6, 7, 8, 9] * 4])
    assert model(input_ids=ids).logits.argmax(dim=1).tolist() == [1, 0]


def test_accelerate_loop_on_barrier_tasks(spark, tmp_path) -> None:
    TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        str(SCRIPTS / "accelerate_loop.py"), "--output", str(tmp_path))
    report = _losses(tmp_path)
    assert report["world"] == 2 and report["distributed"].endswith("MULTI_CPU"), report
    state = torch.load(tmp_path / "model.pt")
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    net.load_state_dict(state)
    x = torch.randn(64, 8)
    assert torch.nn.functional.mse_loss(net(x), x.sum(dim=1, keepdim=True)).item() < 1.0


def _lightning_ddp() -> dict:
    import lightning as L
    import torch

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    x = torch.randn(256, 4)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32)
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=3,
                        enable_progress_bar=False, logger=False, enable_checkpointing=False,
                        enable_model_summary=False)
    model = Regression()
    trainer.fit(model, data)
    return {"world": trainer.world_size, "rank": trainer.global_rank,
            "environment": type(trainer.strategy.cluster_environment).__name__,
            "loss": float(trainer.callback_metrics["loss"]),
            "weight": model.net.weight.detach().numpy().tolist()}


def test_lightning_ddp_strategy_on_our_ranks() -> None:
    results = run_local(_lightning_ddp, num_proc=2)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 for r in results)
    # Lightning found the processes already started (torchrun's), and spawned none.
    assert results[0]["environment"] == "TorchElasticEnvironment"
    assert results[0]["weight"] == results[1]["weight"]  # replicas in sync
    assert results[0]["loss"] < 0.1
