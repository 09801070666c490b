"""TorchEstimator's ``mixed_precision``: autocast, and a GradScaler for float16.

Users of the Estimator cannot reach its training loop, so the Param does what a
Horovod user writes by hand: the forward pass and the loss run under
``torch.autocast`` in ``bfloat16`` or ``float16``, the weights and the optimizer stay
float32. Float16 scales the loss with a ``GradScaler`` and steps in Horovod's order:
``synchronize()`` (the gradients averaged over the ranks), ``scaler.unscale_``, then
``scaler.step`` under ``skip_synchronize()``. Every rank unscales the same averaged
gradients, so an overflow on any rank skips the step, and lowers the scale, on all of
them. Validation and ``transform`` run in float32. The scaler's state is saved in every
epoch and step checkpoint, so a fit that resumes keeps the scale it had reached instead
of skipping steps again while the scale falls from its initial value.

torch is passed in (never imported here): the driver validates the Param without it.
"""

from __future__ import annotations

from typing import Any

from hvd_spark.errors import ConfigError

#: The Param's name and spec (name, doc, converter, default), as ``define`` takes it.
PARAM = "mixed_precision"
PARAM_SPEC: tuple[str, str, Any, Any] = (
    PARAM, "train under torch.autocast: 'bf16' (bfloat16), 'fp16' (float16, with a "
    "GradScaler), None: float32 (default); hvd_spark only", None, None)
MODES = ("bf16", "fp16")


def check_mode(mode: Any, custom_minibatch: bool) -> None:
    """Refuse an unknown mode, or one that a ``train_minibatch_fn`` would bypass.

    Raises:
        ConfigError: Naming the accepted values, or the conflict.
    """
    if mode is None:
        return
    if mode not in MODES:
        raise ConfigError(f"mixed_precision must be 'bf16', 'fp16' or None, got {mode!r}")
    if custom_minibatch:
        raise ConfigError(
            "mixed_precision does not apply to a train_minibatch_fn (it runs the step); "
            "use torch.autocast and a GradScaler inside it, or drop one of the two")


class AmpStep:
    """The Estimator's minibatch and optimizer step under autocast (module docstring)."""

    def __init__(self, mode: str, device: Any, torch: Any) -> None:
        self.torch = torch
        self.device_type = device.type
        self.dtype = torch.float16 if mode == "fp16" else torch.bfloat16
        self.scaler = (torch.amp.GradScaler(device.type) if mode == "fp16" else None)

    def minibatch(self, model: Any, optimizer: Any, transform_outputs: Any, loss_fn: Any,
                  inputs: list, labels: list, sample_weights: Any,
                  backward_passes_per_step: int, batch_idx: int) -> tuple[Any, Any]:
        """Horovod's ``train_minibatch`` signature, as ``default_minibatch``."""
        with self.torch.autocast(self.device_type, dtype=self.dtype):
            outputs, labels = transform_outputs(model(*inputs), labels)
            loss = loss_fn(outputs, labels, sample_weights)
        scaled = loss / backward_passes_per_step if backward_passes_per_step > 1 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        if (batch_idx + 1) % backward_passes_per_step == 0:
            self.step(optimizer)
            optimizer.zero_grad()
        return outputs, loss

    def state_dict(self) -> dict | None:
        """The GradScaler's state for a checkpoint (its loss scale and growth tracker), so
        a resumed fit goes on at the scale it had reached; None without a scaler."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        """Go on from a checkpoint's scaler state (none saved: the scaler starts afresh)."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)

    def step(self, optimizer: Any) -> None:
        """Step the DistributedOptimizer (skipped on every rank after an overflow)."""
        if self.scaler is None:
            optimizer.step()
            return
        optimizer.synchronize()
        self.scaler.unscale_(optimizer)
        with optimizer.skip_synchronize():
            self.scaler.step(optimizer)
        self.scaler.update()
