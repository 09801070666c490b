"""Spark 4's real console stage bar is held off by ``quiet_stage_bar`` (a fresh driver with
Spark's default, the bar on, as in a notebook or a plain script)."""

from __future__ import annotations

import os
import subprocess
import sys

_SCRIPT = """
import sys, time
from pyspark.sql import SparkSession
spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
from hvd_spark.estimator.spark_console import console_bar, quiet_stage_bar
sc = spark.sparkContext

def slow(_):
    time.sleep(1.2)  # the bar shows a stage of 2+ tasks that has run for 500 ms
    return 1

print("bar:", console_bar() is not None, file=sys.stderr, flush=True)
print("== plain", file=sys.stderr, flush=True)
sc.parallelize(range(2), 2).map(slow).count()
print("== quiet", file=sys.stderr, flush=True)
with quiet_stage_bar():
    sc.parallelize(range(2), 2).map(slow).count()
print("== end", file=sys.stderr, flush=True)
"""


def test_sparks_stage_bar_does_not_draw_while_held(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYSPARK_SUBMIT_ARGS"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    err = done.stderr
    assert "bar: True" in err, err[-3000:]
    plain = err[err.index("== plain"):err.index("== quiet")]
    quiet = err[err.index("== quiet"):err.index("== end")]
    assert "[Stage " in plain, "without holding, Spark draws its bar (the test's premise)"
    assert "[Stage " not in quiet, quiet
