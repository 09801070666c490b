"""The layering of DESIGN.md holds: contracts in pyproject.toml, and a clean import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_collectives_import_loads_no_framework():
    code = (
        "import sys, hvd_spark, hvd_spark.collectives, hvd_spark.runner\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in "
        "('pyspark', 'torch', 'tensorflow', 'keras', 'pyarrow')]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or "lint-imports"
    out = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout

