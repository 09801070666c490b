"""The opt-in ``horovod`` alias (hvd_spark.compat): turned on by a call, never shadowing
a real Horovod, never touching hvd_spark's own modules. Each case runs in a fresh
interpreter, since the alias changes the import system of its process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [pythonpath, str(REPO)])),
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def test_off_by_default_and_on_with_one_call() -> None:
    proc = _python(
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('horovod') is None, 'on without being asked'\n"
        "from hvd_spark.compat import enable_horovod_alias, horovod_alias_enabled\n"
        "enable_horovod_alias(); enable_horovod_alias()  # twice is fine\n"
        "import horovod.torch as hvd, hvd_spark.torch\n"
        "assert hvd is hvd_spark.torch and horovod_alias_enabled()\n"
        "print('ok')")
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_children_never_overwrite_hvd_spark_attributes() -> None:
    proc = _python(
        "from hvd_spark.compat import enable_horovod_alias; enable_horovod_alias()\n"
        "import horovod.spark.keras, horovod.spark.torch\n"
        "from horovod.spark.common.store import Store\n"
        "import hvd_spark, hvd_spark.keras, hvd_spark.data, hvd_spark.data.store as ds\n"
        "import hvd_spark.estimator\n"
        "assert horovod.spark.keras is hvd_spark.estimator\n"
        "assert hvd_spark.keras.__name__ == 'hvd_spark.keras'\n"
        "assert hvd_spark.data.store is ds and Store is hvd_spark.data.Store\n"
        "try:\n"
        "    import horovod.mxnet\n"
        "except ModuleNotFoundError as exc:\n"
        "    print('missing', exc.name)\n")
    assert proc.returncode == 0, proc.stderr
    assert "missing horovod.mxnet" in proc.stdout


def test_a_real_horovod_is_never_shadowed(tmp_path: Path) -> None:
    real = tmp_path / "horovod"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    proc = _python(
        "from hvd_spark.compat import enable_horovod_alias\n"
        "from hvd_spark.errors import ConfigError\n"
        "try:\n"
        "    enable_horovod_alias()\n"
        "except ConfigError as exc:\n"
        "    print('refused:', exc)\n"
        "import horovod; assert horovod.REAL\n", pythonpath=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "refused: a real Horovod is installed" in proc.stdout


def test_the_alias_path_serves_import_horovod_without_a_call() -> None:
    from hvd_spark.compat import ALIAS_PATH

    proc = _python("import horovod.torch as hvd, hvd_spark.torch, horovod\n"
                   "assert hvd is hvd_spark.torch and horovod.run is hvd_spark.run\n"
                   "print('ok')", pythonpath=ALIAS_PATH)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
