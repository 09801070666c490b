"""Mixed precision under ``hvd.DistributedOptimizer`` on 2 real local ranks (issue 47).

PyTorch AMP with Horovod's recipe (``GradScaler``; ``synchronize()`` before
``scaler.unscale_``, ``scaler.step`` under ``skip_synchronize()``) and bfloat16 autocast
without a scaler; Keras 3 ``mixed_float16`` with ``keras.mixed_precision.LossScaleOptimizer``
around the DistributedOptimizer, and ``mixed_bfloat16``. Each ends where one process ends
at the same global batch in the same precision, within the tolerance that
``mixed_precision_jobs`` justifies; a loss-scale overflow on one rank skips the step on
every rank, and the replicas stay identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow  # noqa: F401 - CI installs it: never a skip
import torch  # noqa: F401 - CI installs it: never a skip

from hvd_spark.runner.local.local_launcher import run_local
from tests.integration import equivalence_jobs as eq
from tests.integration import mixed_precision_jobs as mj

ENV = {**eq.ENV, "HVD_SPARK_TIMEOUT": "60"}


def _same(a: list, b: list) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def torch_results() -> list[dict]:
    return run_local(mj.torch_amp_job, args=(["fp16", "bf16", "fp16_overflow"],),
                     num_proc=eq.N, env=ENV)


@pytest.fixture(scope="module")
def keras_results() -> list[dict]:
    return run_local(mj.keras_mixed_job,
                     args=(["mixed_float16", "mixed_bfloat16", "mixed_float16_overflow"],),
                     num_proc=eq.N, env=ENV)


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_torch_autocast_matches_one_process(torch_results, mode) -> None:
    r0, r1 = torch_results[0][mode], torch_results[1][mode]
    assert r0["dtypes"] == [f"torch.{'float16' if mode == 'fp16' else 'bfloat16'}"]
    assert _same(r0["final"], r1["final"]), f"{mode}: the ranks' weights differ"
    if mode == "fp16":  # no natural overflow at this scale: every step was taken
        assert r0["scales"] == [mj.INIT_SCALE] * (mj.STEPS * eq.EPOCHS)
        assert r0["unchanged"] == []
    result = eq.compare(r0["final"], mj.torch_amp_plain(r0["init"], mode), r0["init"])
    print(f"torch {mode}: {result}")
    result.check(mj.TOLERANCE[mode], f"torch autocast {mode}")


def test_torch_overflow_on_one_rank_skips_the_step_everywhere(torch_results) -> None:
    r0, r1 = (r["fp16_overflow"] for r in torch_results)
    for r in (r0, r1):  # the step with rank 1's inf changed no weight on either rank
        assert r["unchanged"] == [mj.OVERFLOW_STEP]
        assert r["scales"][mj.OVERFLOW_STEP - 2:mj.OVERFLOW_STEP] == [mj.INIT_SCALE,
                                                                       mj.INIT_SCALE / 2]
    assert r0["scales"] == r1["scales"]
    assert _same(r0["final"], r1["final"]) and _same(r0["momentum"], r1["momentum"])
    plain = mj.torch_amp_plain(r0["init"], "fp16", skip=(mj.OVERFLOW_STEP,))
    result = eq.compare(r0["final"], plain, r0["init"])
    print(f"torch fp16, step {mj.OVERFLOW_STEP} skipped: {result}")
    result.check(mj.TOLERANCE["fp16"], "torch fp16 after an overflow on rank 1")


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_keras_mixed_policy_matches_one_process(keras_results, policy) -> None:
    r0, r1 = keras_results[0][policy], keras_results[1][policy]
    half = "float16" if policy == "mixed_float16" else "bfloat16"
    assert half in r0["output_dtype"]
    assert r0["inner"] == "DistributedSGD"
    assert r0["iterations"] == mj.STEPS
    assert _same(r0["final"], r1["final"]), f"{policy}: the ranks' weights differ"
    result = eq.compare(r0["final"], mj.keras_mixed_plain(r0["init"], policy), r0["init"])
    print(f"keras {policy}: {result}")
    result.check(mj.TOLERANCE["fp16" if half == "float16" else "bf16"], f"keras {policy}")


def test_keras_overflow_on_one_rank_skips_the_step_everywhere(keras_results) -> None:
    """This job failed before: the LossScaleOptimizer of rank 1 skipped the allreduce its
    peer waited in ("rank 1 called shutdown()")."""
    r0, r1 = (r["mixed_float16_overflow"] for r in keras_results)
    for r in (r0, r1):
        assert r["class"] == "LossScaleOptimizer" and r["inner"] == "DistributedSGD"
        assert r["iterations"] == mj.STEPS - 1
        assert r["scale"] == mj.INIT_SCALE / 2
    assert _same(r0["final"], r1["final"])
    plain = mj.keras_mixed_plain(r0["init"], "mixed_float16", skip=(mj.OVERFLOW_STEP,))
    result = eq.compare(r0["final"], plain, r0["init"])
    print(f"keras mixed_float16, step {mj.OVERFLOW_STEP} skipped: {result}")
    result.check(mj.TOLERANCE["fp16"], "keras mixed_float16 after an overflow on rank 1")
