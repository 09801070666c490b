"""A clean import: the collectives and the runner load no framework.

The import contracts in pyproject.toml are checked once, by `make lint` (lint-imports),
which `make test` and `make test-all` run first."""

from __future__ import annotations

import subprocess
import sys


def test_collectives_import_loads_no_framework():
    code = (
        "import sys, hvd_spark, hvd_spark.collectives, hvd_spark.runner\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in "
        "('pyspark', 'torch', 'tensorflow', 'keras', 'pyarrow')]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
