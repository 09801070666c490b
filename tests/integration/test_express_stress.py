"""Randomized stress of the MPI express round and grouped-allreduce packing.

Real ranks under ``hvdrun --mpi``; the rank programs (``express_stress_jobs``) check every
result against numpy themselves (bit for bit where a tensor rides on its request) and
across ranks, and print ``OK stress`` or ``FAIL`` lines. The collective timeout is short,
so a split decision shows up as an error in seconds instead of a hang.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from tests.integration.test_mpi_backend import REPO, _env

ENV = {"HVD_SPARK_TIMEOUT": "20"}
LIMIT_S = 25.0


def _stress(np_: int, seed: int, threads: int, steps: int, **extra: str) -> list[dict]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "hvd_spark.runner", "--mpi", "-np", str(np_), sys.executable,
         "-m", "tests.integration.express_stress_jobs", "stress", str(seed), str(threads),
         str(steps)],
        capture_output=True, text=True, timeout=90, cwd=REPO, env=_env(**ENV, **extra))
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout, out[-8000:]
    assert proc.returncode == 0, out[-8000:]
    counts = [{k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
              for line in proc.stdout.splitlines() if "OK stress " in line]
    assert len(counts) == np_, out[-8000:]
    assert took < LIMIT_S, f"{took:.1f} s"
    return counts


def _check_counts(counts: list[dict]) -> None:
    assert all(c["express"] > 0 for c in counts), counts
    assert any(c["fallbacks"] > 0 for c in counts), counts
    assert all(c["checked"] > 100 for c in counts), counts


@pytest.mark.parametrize("seed,threads", [(1, 2), (2, 3), (3, 3), (12, 3)])
def test_threads_mixing_express_async_and_grouped_calls_on_two_ranks(seed, threads):
    _check_counts(_stress(2, seed, threads, 60))


@pytest.mark.parametrize("seed", [4, 31])
def test_three_ranks(seed):
    _check_counts(_stress(3, seed, 2, 40))


def test_a_timeline_on_rank_0_midway(tmp_path):
    path = tmp_path / "timeline.json"
    _check_counts(_stress(2, 5, 3, 60, EXPRESS_STRESS_TIMELINE=str(path)))
    text = path.read_text()
    assert "t0." in text and "ALLREDUCE" in text, text[:500]
