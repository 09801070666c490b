"""A cluster job submitted with ``spark-submit``, its Python environment shipped as an archive.

The hosts' own Python (what their executors would run without the archive) is a bare
virtualenv: no hvd_spark, no numpy, no TensorFlow. The job (``examples/cluster_job.py``: a
KerasEstimator fit, a ``run()`` step, ``transform``) is submitted in client mode with
``--archives env.tar.gz#environment`` and ``spark.pyspark.python=./environment/bin/python``,
Spark's documented way; the driver runs on the job's environment before packing. It must
train, transform, and its ranks' lines must reach spark-submit's console.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from netns_cluster.hosts import NetnsHosts
from netns_cluster.services import SparkStandalone
from tests import shipped_env
from tests.multihost.conftest import require_namespaces

_REPO = Path(__file__).resolve().parents[2]
_JOB = _REPO / "examples" / "cluster_job.py"
_SUBMIT_TIMEOUT_S = 600.0
# Building and packing the environment, then the job: each executor and the driver copy
# and unpack 1.6 GB. Minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
# Where the hosts' programs come from: the system's, never this test's virtualenv.
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@pytest.fixture(scope="module")
def job_env(tmp_path_factory):
    """``(python, archive)``: the job's environment (the driver's) and its packed copy."""
    root = tmp_path_factory.mktemp("job-env")
    try:
        python = shipped_env.build_job_env(root / "env")
        yield python, shipped_env.pack(root / "env", root / "env.tar.gz")
    finally:  # pytest keeps the last runs' temporary directories: not 2 GB each
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def bare_cluster(tmp_path_factory):
    """``(hosts, cluster, bare_python)``: 2 hosts x 1 slot whose own Python has nothing."""
    require_namespaces()
    bare = shipped_env.bare_venv(tmp_path_factory.mktemp("bare") / "venv")
    net = NetnsHosts(2).start()
    try:
        cluster = SparkStandalone(net, cores=1, worker_env={
            "PYSPARK_PYTHON": str(bare), "PYSPARK_DRIVER_PYTHON": str(bare),
            "PATH": f"{bare.parent}:{_SYSTEM_PATH}", "PYTHONPATH": None,
            "VIRTUAL_ENV": None}).start()
        try:
            yield net, cluster, bare
        finally:
            cluster.close()
    finally:
        net.close()


def _submit_env(cluster: SparkStandalone) -> dict[str, str]:
    from pyspark.find_spark_home import _find_spark_home

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPARK_", "PYSPARK_", "HVD_SPARK_"))
           and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"SPARK_HOME": _find_spark_home(), "PATH": _SYSTEM_PATH,
                "SPARK_LOCAL_IP": cluster.hosts.bridge_addr})
    return env


def test_spark_submit_with_the_environment_shipped(bare_cluster, job_env, tmp_path):
    net, cluster, bare = bare_cluster
    python, archive = job_env
    # The hosts' own Python cannot run the job: everything must come from the archive.
    for module in ("hvd_spark", "numpy", "tensorflow"):
        probe = subprocess.run([str(bare), "-c", f"import {module}"], capture_output=True,
                               env={"PATH": _SYSTEM_PATH}, cwd=tmp_path, timeout=60)
        assert probe.returncode != 0, f"the hosts' own Python imports {module}"
    submit = os.path.join(_submit_env(cluster)["SPARK_HOME"], "bin", "spark-submit")
    bridge = net.bridge_addr
    argv = [
        submit, "--master", cluster.master_url, "--deploy-mode", "client",
        "--archives", f"{archive}#environment",
        "--conf", "spark.pyspark.python=./environment/bin/python",
        "--conf", f"spark.pyspark.driver.python={python}",
        "--conf", f"spark.driver.host={bridge}", "--conf", f"spark.driver.bindAddress={bridge}",
        "--conf", "spark.executor.cores=1", "--conf", "spark.cores.max=2",
        "--conf", "spark.executor.memory=768m", "--conf", "spark.driver.memory=1g",
        "--conf", "spark.ui.enabled=false", "--conf", "spark.ui.showConsoleProgress=false",
        "--conf", "spark.sql.shuffle.partitions=2",
        str(_JOB), "--num-proc", "2", "--store", str(tmp_path / "store"), "--epochs", "4",
    ]
    try:
        done = subprocess.run(argv, env=_submit_env(cluster), cwd=tmp_path,
                              capture_output=True, text=True, timeout=_SUBMIT_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"spark-submit did not finish within {_SUBMIT_TIMEOUT_S:.0f} s:\n"
                    f"{exc.stdout}\n{exc.stderr}\n{cluster.logs_tail()}")
    out = done.stdout
    report = f"stdout:\n{out}\nstderr (tail):\n{done.stderr[-6000:]}"
    assert done.returncode == 0, report

    # 1. The fit trained (its lines are printed by the driver after the ranks' epochs).
    fit = re.search(r"^fit: loss ([\d.]+) -> ([\d.]+), accuracy ([\d.]+)$", out, re.M)
    assert fit and float(fit[2]) < 0.7 * float(fit[1]), report
    # 2. The run() step: each rank's own line reached this console, prefixed with its
    # rank, from both hosts, each running the archive unpacked in its executor's directory.
    rank_lines = re.findall(r"^\[(\d)\] rank (\d) of 2 on (\S+): accuracy ([\d.]+) .*; "
                            r"python (\S+); hvd_spark from (\S+)$", out, re.M)
    assert sorted((p, r) for p, r, *_ in rank_lines) == [("0", "0"), ("1", "1")], report
    assert {host for _, _, host, *_ in rank_lines} == set(net.hostnames), report
    for _, _, _, accuracy, exe, package in rank_lines:
        assert float(accuracy) > 0.85, report
        assert exe.startswith(cluster.workdir) and exe.endswith("/environment/bin/python")
        env_root = exe[: -len("bin/python")]
        assert package.startswith(env_root + "lib/"), (package, env_root)
    # 3. transform predicted on the executors.
    scored = re.search(r"^transform: accuracy ([\d.]+) on 400 held-out rows$", out, re.M)
    assert scored and float(scored[1]) > 0.85, report
    # The job's estimator ran its ranks from the archive too (no lost task, no retry).
    assert "Traceback" not in out, report
    assert sys.executable not in out
