"""TorchEstimator's AmpStep keeps its GradScaler's state across a checkpoint (issue 47)."""

from __future__ import annotations

import torch

from hvd_spark.estimator.torch_amp import AmpStep


def _overflowed_step(amp: AmpStep) -> None:
    """One fp16 step whose gradient is inf: the scaler skips it and lowers its scale."""
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    amp.scaler.scale((weight * torch.tensor([float("inf"), 1.0])).sum()).backward()
    amp.scaler.step(optimizer)
    amp.scaler.update()
    assert torch.equal(weight.detach(), torch.ones(2))  # skipped


def test_fp16_scaler_state_round_trips() -> None:
    cpu = torch.device("cpu")
    trained = AmpStep("fp16", cpu, torch)
    _overflowed_step(trained)
    state = trained.state_dict()
    assert state["scale"] == 2.0 ** 15  # backed off once from 2^16

    resumed = AmpStep("fp16", cpu, torch)
    resumed.load_state_dict(state)
    assert resumed.scaler.get_scale() == 2.0 ** 15
    assert resumed.state_dict() == state

    fresh = AmpStep("fp16", cpu, torch)
    fresh.load_state_dict(None)  # a checkpoint written before the scaler was saved
    assert fresh.scaler.get_scale() == 2.0 ** 16


def test_bf16_has_no_scaler_state() -> None:
    amp = AmpStep("bf16", torch.device("cpu"), torch)
    assert amp.state_dict() is None
    amp.load_state_dict({"scale": 4.0})  # nothing to restore: ignored
    assert amp.scaler is None
