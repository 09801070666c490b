"""Horovod's module paths, as its Spark examples and docs import them (issue 33).

For each import statement: (a) the hvd_spark counterpart imports as a module and has the
names, and (b) the very statement works through the ``horovod`` compatibility alias (the
directory ``hvd_spark.compat.ALIAS_PATH`` on ``PYTHONPATH``, as a user turns it on) in a fresh
interpreter, giving hvd_spark's own objects. All statements run in one subprocess, which
prints a JSON report.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hvd_spark.compat import ALIAS_PATH

REPO = Path(__file__).resolve().parents[2]
ALIAS = Path(ALIAS_PATH)
_MARK = "HOROVOD-PATHS-REPORT "


@dataclasses.dataclass(frozen=True)
class Case:
    """One Horovod import statement and where hvd_spark serves it.

    Attributes:
        statement: The statement exactly as Horovod's examples write it.
        module: The hvd_spark module that holds its names.
        names: What the statement brings in (``from ... import``) or what code uses on the
            module it binds (``import ... as hvd``).
    """

    statement: str
    module: str
    names: tuple[str, ...]


CASES = [
    Case("import horovod.tensorflow as hvd", "hvd_spark.tensorflow",
         ("init", "DistributedOptimizer", "callbacks", "elastic")),
    Case("import horovod.tensorflow.keras as hvd", "hvd_spark.tensorflow.keras",
         ("init", "DistributedOptimizer", "callbacks", "elastic", "load_model")),
    Case("import horovod.torch as hvd", "hvd_spark.torch",
         ("init", "DistributedOptimizer", "broadcast_parameters", "elastic")),
    Case("import horovod.keras as hvd", "hvd_spark.keras",
         ("init", "DistributedOptimizer", "callbacks", "elastic")),
    Case("from horovod.spark.common.store import Store", "hvd_spark.data", ("Store",)),
    Case("from horovod.spark.common.backend import SparkBackend", "hvd_spark.runner.backend",
         ("SparkBackend",)),
    Case("import horovod.spark.keras as hvd", "hvd_spark.estimator",
         ("KerasEstimator", "KerasModel")),
    Case("import horovod.spark.lightning as hvd", "hvd_spark.estimator.lightning",
         ("TorchEstimator", "TorchModel")),
    Case("import horovod.spark.torch as hvd", "hvd_spark.estimator",
         ("TorchEstimator", "TorchModel")),
    Case("import horovod.spark", "hvd_spark", ("run", "run_elastic")),
    Case("from horovod.spark import run", "hvd_spark", ("run",)),
    Case("from horovod.spark import run_elastic", "hvd_spark", ("run_elastic",)),
    Case("from horovod.spark.lightning.estimator import MIN_PL_VERSION",
         "hvd_spark.estimator.lightning", ("MIN_PL_VERSION",)),
    Case("from horovod.tensorflow.keras.callbacks import BestModelCheckpoint",
         "hvd_spark.tensorflow.keras.callbacks", ("BestModelCheckpoint",)),
    Case("from horovod.spark.task import get_available_devices", "hvd_spark.task",
         ("get_available_devices",)),
    Case("import horovod.torch.elastic", "hvd_spark.torch.elastic",
         ("TorchState", "ElasticSampler", "run")),
    Case("import horovod.tensorflow.elastic", "hvd_spark.tensorflow.elastic",
         ("TensorFlowState", "run")),
    Case("import horovod.tensorflow.keras.elastic", "hvd_spark.tensorflow.keras.elastic",
         ("KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
          "UpdateEpochStateCallback", "run")),
    Case("import horovod.keras.elastic", "hvd_spark.keras.elastic",
         ("KerasState", "CommitStateCallback", "run")),
    Case("import horovod.keras.callbacks", "hvd_spark.keras.callbacks",
         ("BroadcastGlobalVariablesCallback", "MetricAverageCallback",
          "LearningRateWarmupCallback", "LearningRateScheduleCallback", "BestModelCheckpoint")),
    Case("from horovod.spark.common.util import prepare_data", "hvd_spark.data.dataset_index",
         ("prepare_data",)),
    Case("from horovod.keras import PartialDistributedOptimizer", "hvd_spark.keras",
         ("PartialDistributedOptimizer",)),
]

# Runs in the fresh interpreter: each statement, then whether what it bound is hvd_spark's.
_PROBE = r'''
import importlib, json, sys, traceback

def probe(statement, module, names):
    ns = {}
    try:
        exec(statement, ns)
        target = importlib.import_module(module)
        if statement.startswith("from "):
            got = {n: ns[n] for n in names}
        else:
            bound = statement.split(" as ")[1] if " as " in statement else statement.split()[1]
            obj = eval(bound, ns)
            got = {n: getattr(obj, n) for n in names}
        other = [n for n in names if got[n] is not getattr(target, n)]
        return {"ok": not other, "error": f"not hvd_spark's object: {other}" if other else ""}
    except BaseException:
        return {"ok": False, "error": traceback.format_exc(limit=3)}

cases = json.loads(sys.argv[1])
print("''' + _MARK + r'''" + json.dumps({c[0]: probe(*c) for c in cases}), flush=True)
'''


def _case_id(case: Case) -> str:
    return case.statement.replace("import ", "").replace("from ", "").replace(" ", "_")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_hvd_spark_counterpart_is_a_module_with_the_names(case: Case) -> None:
    module = importlib.import_module(case.module)
    assert isinstance(module, types.ModuleType)
    assert sys.modules[case.module] is module, f"{case.module} is not registered as a module"
    missing = [n for n in case.names if not hasattr(module, n)]
    assert not missing, f"{case.module} lacks {missing} (for `{case.statement}`)"


@pytest.fixture(scope="module")
def alias_report() -> dict[str, dict]:
    """Run every statement through the compat alias in one fresh interpreter."""
    assert (ALIAS / "horovod" / "__init__.py").is_file(), f"no horovod package in {ALIAS}"
    env = {**os.environ, "PYTHONPATH": str(ALIAS), "TF_CPP_MIN_LOG_LEVEL": "3"}
    cases = [[c.statement, c.module, list(c.names)] for c in CASES]
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
    assert proc.returncode == 0 and lines, (
        f"the alias probe failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(_MARK):])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_horovod_statement_works_through_the_compat_alias(case: Case, alias_report) -> None:
    result = alias_report[case.statement]
    assert result["ok"], f"`{case.statement}` through the alias: {result['error']}"


def test_min_pl_version_is_the_lightning_extras_floor() -> None:
    import lightning
    from packaging.version import Version

    from hvd_spark.estimator.lightning import MIN_PL_VERSION

    floor = re.search(r'"lightning>=([0-9.]+)"', (REPO / "pyproject.toml").read_text())
    assert floor, "pyproject.toml has no lightning>= requirement"
    assert Version(MIN_PL_VERSION) == Version(floor.group(1))
    assert isinstance(MIN_PL_VERSION, str)
    assert Version(lightning.__version__) >= Version(MIN_PL_VERSION)


def test_submodule_aliases_are_the_real_modules() -> None:
    import hvd_spark.keras
    import hvd_spark.keras.callbacks
    import hvd_spark.tensorflow
    import hvd_spark.tensorflow.keras
    import hvd_spark.tensorflow.keras.callbacks
    import hvd_spark.tensorflow.keras.elastic

    # One module object under every name, so `hvd.callbacks` and the import agree.
    real_callbacks = hvd_spark.tensorflow.callbacks
    assert sys.modules["hvd_spark.tensorflow.keras.callbacks"] is real_callbacks
    assert sys.modules["hvd_spark.keras.callbacks"] is real_callbacks
    assert hvd_spark.tensorflow.keras.callbacks is real_callbacks
    assert hvd_spark.keras.callbacks is real_callbacks
    assert sys.modules["hvd_spark.tensorflow.keras.elastic"] is hvd_spark.tensorflow.elastic
    assert hvd_spark.tensorflow.keras.elastic is hvd_spark.tensorflow.elastic
