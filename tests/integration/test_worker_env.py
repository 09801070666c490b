"""Every launcher gives each rank Horovod's and torch's variables, matching its place.

Real processes: run_local, the hvdrun CLI, and hvd_spark.run on local[2] Spark.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys

import pyspark  # noqa: F401 - CI installs it: never a skip

import hvd_spark
from hvd_spark.runner import run_local

_NAMES = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
          "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "RANK", "LOCAL_RANK",
          "WORLD_SIZE", "LOCAL_WORLD_SIZE", "HVD_SPARK_HOSTNAME")


def _seen() -> dict:
    """What one rank sees: its variables, and where init() placed it."""
    import hvd_spark.collectives as hvd

    hvd.init()
    env = {name: os.environ.get(name) for name in _NAMES}
    return {"env": env, "world": [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(),
                                  hvd.cross_rank(), hvd.cross_size()]}


def _expected(rank: int, size: int, host: str) -> dict:
    # One host: local rank = rank, one "cross" group.
    return {
        "env": {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
                "HOROVOD_LOCAL_RANK": str(rank), "HOROVOD_LOCAL_SIZE": str(size),
                "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1", "HOROVOD_HOSTNAME": host,
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size),
                "LOCAL_WORLD_SIZE": str(size), "HVD_SPARK_HOSTNAME": host},
        "world": [rank, size, rank, size, 0, 1],
    }


def test_run_local_ranks_see_horovod_and_torch_variables():
    # The user's env cannot shadow the rank's own variables.
    results = run_local(_seen, num_proc=2, env={"RANK": "7", "HOROVOD_SIZE": "9"})
    host = socket.gethostname()
    assert results == [_expected(0, 2, host), _expected(1, 2, host)]


def test_hvdrun_ranks_see_horovod_and_torch_variables(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(
        "import json, os, sys\n"
        f"names = {_NAMES!r}\n"
        "out = {n: os.environ.get(n) for n in names}\n"
        "path = os.path.join(sys.argv[1], os.environ['RANK'] + '.json')\n"
        "open(path, 'w').write(json.dumps(out))\n")
    proc = subprocess.run(
        [sys.executable, "-m", "hvd_spark.runner", "-np", "3", sys.executable, str(script),
         str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    host = socket.gethostname()
    for rank in range(3):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen == _expected(rank, 3, host)["env"]


def test_spark_run_ranks_see_horovod_and_torch_variables(spark):
    results = hvd_spark.run(_seen, num_proc=2, stdout=io.StringIO())
    host = results[0]["env"]["HVD_SPARK_HOSTNAME"]
    assert host  # the executor's host name, as the driver registered it
    assert results == [_expected(0, 2, host), _expected(1, 2, host)]
