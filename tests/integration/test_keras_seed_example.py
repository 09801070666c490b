"""The Horovod-era seed example (examples/keras_seed.py) trains on 2 ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import tensorflow  # noqa: F401 - CI installs it: never a skip

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "keras_seed.py"


def test_seed_example_through_hvdrun():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "HVD_SPARK_TIMEOUT": "60"}
    proc = subprocess.run(
        [sys.executable, "-m", "hvd_spark.runner", "-np", "2", sys.executable, str(EXAMPLE)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = dict(re.findall(r"rank (\d)/2: loss [\d.]+ weights checksum (\S+)", proc.stdout))
    assert set(found) == {"0", "1"}, proc.stdout[-3000:]
    assert found["0"] == found["1"]  # the ranks end with the same weights


def test_seed_example_through_hvd_spark_run(spark):
    """End to end through hvd_spark.run: Spark barrier tasks as ranks."""
    import cloudpickle
    import pyspark  # noqa: F401 - CI installs it: never a skip

    import hvd_spark

    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import keras_seed
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    cloudpickle.register_pickle_by_value(keras_seed)  # examples/ is not on the workers' path
    results = hvd_spark.run(keras_seed.train, num_proc=2,
                            env={"TF_CPP_MIN_LOG_LEVEL": "3", "HVD_SPARK_TIMEOUT": "60"})
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["weights_sum"] == results[1]["weights_sum"]
    assert results[0]["loss"][-1] < 0.69  # it learned something (chance: ln 2)
