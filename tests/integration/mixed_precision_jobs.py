"""Rank jobs and plain references of the mixed-precision tests (issue 47).

Both sides train the equivalence tests' MLP on the same global batches
(``equivalence_jobs``): N ranks at batch b, one process at batch N*b, in the same
precision. This module is pickled by value to the ranks (tests/ is not on their path).

Tolerances (``TOLERANCE``), in the equivalence tests' form ``max|w_dist - w_plain| <=
rel * max|w_plain - w_init| + abs``. Under autocast a weight's gradient comes out of a
half-precision matmul: it is rounded to the format's precision (unit roundoff u = 2^-11
for float16, 2^-8 for bfloat16) once per rank over its b rows, where the plain run rounds
it once over all N*b rows. The two gradients differ by about u relative to the per-rank
partial gradients, every step, and training carries the differences along. The bound is
rel = 4 u (fp16 2.0e-3, bf16 1.6e-2) plus abs = u * lr for weights that barely move;
the measured ratios are in the tests' output (torch: fp16 1.1e-4, bf16 1.7e-3; about
u/4 and u/2, so the bound leaves a factor of 10 to 20). A real bug is larger: a rank's
gradient lost moves the weights by 0.16 of their movement (``equivalence_jobs``); a step
taken on one rank only after an overflow moves that rank's weights by a whole step, which
the tests compare bitwise.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import cloudpickle
import numpy as np

from tests.integration import equivalence_jobs as eq

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on the workers' path

LR = eq.SGD_LR
STEPS = eq.ROWS // (eq.N * eq.BATCH)  # optimizer steps per epoch
INIT_SCALE = 2.0 ** 8  # GradScaler's start: no natural overflow at this loss (tests assert)
OVERFLOW_STEP = 3  # the step at which rank 1 feeds an inf in the overflow case
UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
TOLERANCE = {mode: eq.Tolerance(rel=4 * u, abs=u * LR) for mode, u in UNIT_ROUNDOFF.items()}


def _dtype(mode: str) -> Any:
    import torch

    return torch.float16 if mode == "fp16" else torch.bfloat16


def torch_amp_job(modes: list[str]) -> dict[str, Any]:
    """Each rank: for every mode, 2 epochs of the seeded MLP under ``torch.autocast`` with
    ``hvd.DistributedOptimizer`` (SGD with momentum) on its rows of every global batch.

    ``"fp16"`` follows Horovod's recipe with a ``GradScaler``: ``synchronize()``, then
    ``scaler.unscale_``, then ``scaler.step`` under ``skip_synchronize()``. ``"bf16"``
    has no scaler. ``"fp16_overflow"`` is ``"fp16"`` where, at ``OVERFLOW_STEP``, rank 1's
    input holds an inf: every rank must skip that step. Returns mode -> the initial and
    final weights, the output dtype seen under autocast, the loss scales after each step
    and the steps at which the weights did not change.
    """
    import torch

    import hvd_spark.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = eq.dataset()
    out: dict[str, Any] = {"rank": rank}
    for mode in modes:
        half = "fp16" if mode.startswith("fp16") else "bf16"
        model = eq.torch_model()
        opt = eq.torch_optimizer("sgd", model.parameters(), LR)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        init = eq.torch_weights(model)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE) if half == "fp16" else None
        scales, unchanged, dtypes = [], [], set()
        model.train()
        step_no = 0
        for _ in range(eq.EPOCHS):
            for step in range(STEPS):
                step_no += 1
                rows = eq.rank_rows(step, rank, size, eq.BATCH)
                inputs = torch.from_numpy(x[rows].copy())
                if mode == "fp16_overflow" and step_no == OVERFLOW_STEP and rank == 1:
                    inputs[0, 0] = float("inf")
                before = eq.torch_weights(model)
                with torch.autocast("cpu", dtype=_dtype(half)):
                    logits = model(inputs)
                    dtypes.add(str(logits.dtype))
                    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y[rows]))
                if scaler is None:
                    loss.backward()
                    opt.step()
                else:
                    scaler.scale(loss).backward()
                    opt.synchronize()  # the averaged gradients, before they are unscaled
                    scaler.unscale_(opt)
                    with opt.skip_synchronize():
                        scaler.step(opt)
                    scaler.update()
                    scales.append(float(scaler.get_scale()))
                opt.zero_grad()
                if all(np.array_equal(a, b) for a, b in zip(before, eq.torch_weights(model))):
                    unchanged.append(step_no)
        opt.remove_hooks()
        out[mode] = {"init": init, "final": eq.torch_weights(model), "dtypes": sorted(dtypes),
                     "scales": scales, "unchanged": unchanged,
                     "momentum": [opt.state[p]["momentum_buffer"].numpy().copy()
                                  for p in model.parameters()]}
    return out


def torch_amp_plain(init: eq.Weights, mode: str, skip: tuple[int, ...] = (),
                    batches: Any = None, lr: float = LR, init_scale: float = INIT_SCALE
                    ) -> eq.Weights:
    """One process in the same precision (a GradScaler for fp16) on ``batches`` (default:
    the global batches of ``EPOCHS`` epochs); the steps numbered in ``skip`` are left out
    (a skipped overflow step)."""
    import torch

    model = eq.torch_model()
    with torch.no_grad():
        for p, w in zip(model.parameters(), init):
            p.copy_(torch.from_numpy(w))
    opt = eq.torch_optimizer("sgd", model.parameters(), lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if mode == "fp16" else None
    model.train()
    if batches is None:
        batches = eq.global_batches(*eq.dataset(), eq.N * eq.BATCH, eq.EPOCHS)
    for step_no, (bx, by) in enumerate(batches, start=1):
        if step_no in skip:
            continue
        opt.zero_grad()
        with torch.autocast("cpu", dtype=_dtype(mode)):
            loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(bx)),
                                                     torch.from_numpy(by))
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return eq.torch_weights(model)


# ------------------------------------------------------------------------------- keras


def keras_mixed_job(policies: list[str]) -> dict[str, Any]:
    """Each rank: for every Keras dtype policy, ``model.fit`` the seeded MLP built under it,
    compiled with ``hvd.DistributedOptimizer(SGD)`` (under ``"mixed_float16"`` inside
    ``keras.mixed_precision.LossScaleOptimizer``), on this rank's rows of every global
    batch. ``"mixed_float16_overflow"``: rank 1's input at ``OVERFLOW_STEP``
    holds an inf. Returns policy -> weights, the optimizer's class, its loss scale and
    iterations, and the output dtype."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    import hvd_spark.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = eq.dataset()
    mine = [eq.rank_rows(s, rank, size, eq.BATCH) for s in range(STEPS)]
    out: dict[str, Any] = {"rank": rank}
    try:
        for name in policies:
            policy = name.replace("_overflow", "")
            keras.mixed_precision.set_global_policy(policy)
            xs = np.concatenate([x[r] for r in mine])
            if name.endswith("_overflow") and rank == 1:
                xs[(OVERFLOW_STEP - 1) * eq.BATCH, 0] = np.inf
            ys = np.concatenate([y[r] for r in mine])
            model = eq.keras_model()
            init = [np.asarray(w) for w in model.get_weights()]
            opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=eq.MOMENTUM))
            if policy == "mixed_float16":
                opt = keras.mixed_precision.LossScaleOptimizer(opt, initial_scale=INIT_SCALE)
            model.compile(opt, eq.keras_loss())
            model.fit(xs, ys, batch_size=eq.BATCH, epochs=1, shuffle=False, verbose=0)
            opt = model.optimizer
            out[name] = {
                "init": init, "final": [np.asarray(w) for w in model.get_weights()],
                "class": type(opt).__name__,
                "inner": type(getattr(opt, "inner_optimizer", opt)).__name__,
                "iterations": int(opt.iterations.numpy()),
                "scale": (float(opt.dynamic_scale.numpy()) if hasattr(opt, "dynamic_scale")
                          else None),
                "output_dtype": str(model(xs[:2]).dtype),
            }
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return out


def keras_mixed_plain(init: eq.Weights, policy: str, skip: tuple[int, ...] = (),
                      batches: Any = None, initial_scale: float = INIT_SCALE) -> eq.Weights:
    """One process under ``policy`` (the same loss scaling) on ``batches`` (default: one
    epoch of the global batches); the steps numbered in ``skip`` are left out."""
    import keras

    keras.mixed_precision.set_global_policy(policy)
    try:
        model = eq.keras_model()
        model.set_weights(init)
        opt = keras.optimizers.SGD(LR, momentum=eq.MOMENTUM)
        if policy == "mixed_float16":
            opt = keras.mixed_precision.LossScaleOptimizer(opt, initial_scale=initial_scale)
        model.compile(opt, eq.keras_loss())
        if batches is None:
            batches = eq.global_batches(*eq.dataset(), eq.N * eq.BATCH, 1)
        for step_no, (bx, by) in enumerate(batches, start=1):
            if step_no not in skip:
                model.train_on_batch(bx, by)
        return [np.asarray(w) for w in model.get_weights()]
    finally:
        keras.mixed_precision.set_global_policy("float32")
