"""Two ranks on half batches end where one process on full batches ends (issue 4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch  # noqa: F401 - CI installs it: never a skip

from hvd_spark.runner.local.local_launcher import run_local  # noqa: E402
from tests.integration import torch_training_cases as cases  # noqa: E402


@pytest.fixture(scope="module")
def distributed_results():
    return run_local(cases.train_all_distributed, num_proc=2)


@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_matches_single_process_and_ranks_agree(name, distributed_results):
    case = cases.CASES[name]
    reference = cases.train(case, distributed=False)
    rank0, rank1 = (r[name] for r in distributed_results)
    rtol, atol = (2e-2, 2e-3) if case.get("compression") == "fp16" else (1e-5, 1e-6)
    for key, expected in reference.items():
        assert np.array_equal(rank0[key], rank1[key]), f"{name}: {key} differs between ranks"
        np.testing.assert_allclose(rank0[key], expected, rtol=rtol, atol=atol,
                                   err_msg=f"{name}: {key}")
    # The case must actually train: parameters moved away from their initial values.
    initial = cases.make_model(case["model"]).state_dict()
    moved = [k for k in reference if k.startswith(("0.", "trunk"))]
    assert any(not np.allclose(reference[k], initial[k].numpy()) for k in moved)
