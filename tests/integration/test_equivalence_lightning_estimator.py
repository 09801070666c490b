"""LightningEstimator trains the model a plain Lightning Trainer trains (issue 33): 2 ranks at
batch b end with the weights of one process at batch 2b (2b*bpps with
backward_passes_per_step=bpps, i.e. the Trainer's accumulate_grad_batches).

A ``transformation_fn`` records every batch each rank trains on; the k-th batches of the
ranks together are the plain run's k-th global batch. LightningEstimator uses the learning
rate as given (Horovod's Lightning estimator does not scale it either), so the plain run
uses the same rate. Tolerances: ``equivalence_jobs``.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from typing import Any

import cloudpickle
import lightning.pytorch as pl
import numpy as np
import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest
import torch

import hvd_spark.torch as hvd
from hvd_spark.estimator import LightningEstimator
from tests.integration import equivalence_jobs as jobs

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on the workers' path

LR = jobs.LR

# One fit each (a fit costs ~20 s); the run()-based tests cover the full matrix. fp16 here
# too: the strategy averages after every backward pass, so with accumulation the
# partly averaged gradients are compressed again.
CASES = {
    "adam": {"opt": "adam", "bpps": 1, "fp16": False},
    "sgd_momentum_bpps2": {"opt": "sgd", "bpps": 2, "fp16": False},
    "sgd_momentum_bpps2_fp16": {"opt": "sgd", "bpps": 2, "fp16": True},
}


class MLP(pl.LightningModule):
    """The equivalence MLP (``jobs.torch_model``) with the mean cross-entropy."""

    def __init__(self, optimizer: str, lr: float) -> None:
        super().__init__()
        self.net = jobs.torch_model()
        self.optimizer_name, self.lr = optimizer, lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self(batch["features"]), batch["label"])

    def configure_optimizers(self) -> Any:
        return jobs.torch_optimizer(self.optimizer_name, self.parameters(), self.lr)


class EpochBatches:
    """The plain Trainer's data: each ``iter()`` serves the next epoch's global batches."""

    def __init__(self, batches: list[tuple[np.ndarray, np.ndarray]], epochs: int) -> None:
        self.per_epoch = len(batches) // epochs
        self.batches, self.served = batches, 0

    def __len__(self) -> int:
        return self.per_epoch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        start, self.served = self.served * self.per_epoch, self.served + 1
        for x, y in self.batches[start:start + self.per_epoch]:
            yield {"features": torch.from_numpy(x), "label": torch.from_numpy(y)}


def _plain_lightning(module: MLP, batches: list[tuple[np.ndarray, np.ndarray]]) -> jobs.Weights:
    """Plain Lightning: one CPU process, one optimizer step per (global) batch."""
    data = EpochBatches(batches, jobs.EPOCHS)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=jobs.EPOCHS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=data)
    assert data.served == jobs.EPOCHS, f"the plain Trainer read {data.served} epochs"
    return jobs.torch_weights(module)


@pytest.fixture(scope="module", params=list(CASES))
def fitted(request, equivalence_frame, tmp_path_factory) -> dict:
    """One LightningEstimator fit of a case: its initial and final weights, the batches the
    ranks trained on, and the plain Trainer's final weights on them."""
    case = CASES[request.param]
    module = MLP(case["opt"], LR[case["opt"]])
    initial = copy.deepcopy(module)  # the estimator ships the module it is given
    recorded = tmp_path_factory.mktemp("batches")
    est = LightningEstimator(
        num_proc=jobs.N, model=module, feature_cols=["features"], label_cols=["label"],
        batch_size=jobs.BATCH, epochs=jobs.EPOCHS, shuffle=True, random_seed=7, verbose=0,
        use_gpu=False, backward_passes_per_step=case["bpps"],
        gradient_compression=hvd.Compression.fp16 if case["fp16"] else None,
        transformation_fn=jobs.BatchRecorder(str(recorded)),
        store=str(tmp_path_factory.mktemp("store")))
    final = jobs.torch_weights(est.fit(equivalence_frame).getModel())
    steps = jobs.EPOCHS * jobs.ROWS // (jobs.N * jobs.BATCH)
    batches = jobs.recorded_global_batches(str(recorded), jobs.N, steps, "features", "label")
    init = jobs.torch_weights(initial)
    plain = _plain_lightning(initial, jobs.merge_steps(batches, case["bpps"]))
    return {"name": request.param, "case": case, "batches": batches, "init": init,
            "plain": plain, "final": final}


def test_ranks_trained_on_every_row_each_epoch(fitted) -> None:
    x, _ = jobs.dataset()
    jobs.check_epochs_cover_dataset(fitted["batches"], jobs.EPOCHS, x)


def test_lightning_estimator_matches_plain_lightning(fitted) -> None:
    case, name = fitted["case"], fitted["name"]
    result = jobs.compare(fitted["final"], fitted["plain"], fitted["init"])
    print(f"LightningEstimator {name}: {result}")
    tol = jobs.tolerance(case["opt"], LR[case["opt"]], case["fp16"])
    result.check(tol, f"LightningEstimator {name}")
