"""Faults injected into real rank processes: a kill mid-transfer, /dev/shm that cannot be reserved.

The ranks are started here (not through run_local, whose launcher stops every rank
when one fails): the survivor must notice the dead peer by itself.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hvd_spark.collectives.tcp.store import StoreServer
from hvd_spark.runner.local.local_launcher import rank_env

_RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import hvd_spark.collectives as hvd
    hvd.init()
    big = np.ones(16 * 1024 * 1024, np.float32)  # 64 MB: every allreduce takes a while
    print("ready", flush=True)
    step = 0
    try:
        while True:
            hvd.allreduce(big, name=f"big.{step}")
            step += 1
            if hvd.rank() == 1 and step == 2:
                print("busy", flush=True)  # the test kills this rank from now on
    except Exception as exc:
        print(f"raised {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
""")


def _start_ranks(num_proc: int, extra_env: dict[str, str]) -> tuple[StoreServer, list]:
    secret = secrets.token_bytes(32)
    store = StoreServer(secret, "127.0.0.1")
    procs = []
    for rank in range(num_proc):
        env = {**os.environ, **extra_env, **rank_env(rank, num_proc, store.port, secret)}
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True))
    return store, procs


def _wait_line(proc: subprocess.Popen, want: str, timeout: float) -> list[str]:
    """Read ``proc``'s lines until one equals ``want``; fail after ``timeout`` s."""
    import selectors

    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(deadline - time.monotonic()):
                break
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            if line.strip() == want:
                return lines
    raise AssertionError(f"no {want!r} from the rank within {timeout} s; got {lines}")


@pytest.mark.parametrize("disable_shm", ["0", "1"], ids=["shm", "tcp"])
def test_survivor_raises_within_seconds_naming_the_rank_killed_mid_allreduce(disable_shm):
    # A long collective timeout: only detecting the dead peer can end rank 0's wait in time.
    store, procs = _start_ranks(2, {"HVD_SPARK_TIMEOUT": "300",
                                    "HVD_SPARK_DISABLE_SHM": disable_shm})
    try:
        _wait_line(procs[1], "busy", 120)
        procs[1].kill()  # SIGKILL while allreduces of 64 MB are in flight
        killed_at = time.monotonic()
        procs[1].wait(10)
        out, _ = procs[0].communicate(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        store.close()
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode == 3, out
    raised = [line for line in out.splitlines() if line.startswith("raised ")]
    assert raised, out
    assert "rank 1" in raised[0], raised[0]
    assert "did not complete" not in raised[0], raised[0]
    assert elapsed < 30, f"rank 0 raised {elapsed:.1f} s after the kill: {raised[0]}"
