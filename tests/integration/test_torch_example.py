"""examples/torch_train.py runs under hvdrun (and, when present, on local Spark)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch  # noqa: F401 - CI installs it: never a skip

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.smoke
def test_example_trains_under_hvdrun():
    proc = subprocess.run(
        [sys.executable, "-m", "hvd_spark.runner", "-np", "2", "--timeout", "120",
         sys.executable, "examples/torch_train.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    final = re.search(r"final loss ([0-9.]+) on 2 ranks", proc.stdout)
    assert final, proc.stdout
    assert float(final.group(1)) < 0.1, proc.stdout


def test_example_and_training_case_on_local_spark(spark):
    """End to end through hvd_spark.run: Spark barrier tasks as ranks."""
    import cloudpickle

    import hvd_spark
    from tests.integration import torch_training_cases as cases

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import torch_train
    finally:
        sys.path.remove(str(ROOT / "examples"))
    cloudpickle.register_pickle_by_value(torch_train)  # examples/ is not on the workers' path
    losses = hvd_spark.run(torch_train.train, kwargs={"epochs": 3}, num_proc=2)
    assert len(losses) == 2 and losses[0] == losses[1] and losses[0] < 0.2

    case = cases.CASES["adam"]
    results = hvd_spark.run(cases.train, args=(case, True), num_proc=2)
    reference = cases.train(case, distributed=False)
    for key, expected in reference.items():
        assert (results[0][key] == results[1][key]).all(), key
        np.testing.assert_allclose(results[0][key], expected, rtol=1e-5, atol=1e-6)
