"""hvd_spark.run on a real local[2] Spark session (one session for the module)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
import uuid

import pyspark  # noqa: F401 - CI installs it: never a skip
import pytest

import hvd_spark  # noqa: E402
from hvd_spark.errors import ConfigError, WorkerFailedError  # noqa: E402


def _pids_with_marker(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (no psutil needed)."""
    needle = marker.encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


def _wait_no_marker(marker: str, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := _pids_with_marker(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _world_and_sum():
    import numpy as np

    import hvd_spark.collectives as hvd

    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0, 10.0]), op=hvd.ReduceOp.Sum)
    return (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
            hvd.cross_size(), total.tolist())


@pytest.mark.smoke
def test_results_in_rank_order_with_collectives(spark):
    results = hvd_spark.run(_world_and_sum, num_proc=2, stdout=io.StringIO())
    assert results == [
        (0, 2, 0, 2, 0, 1, [3.0, 20.0]),
        (1, 2, 1, 2, 0, 1, [3.0, 20.0]),
    ]


def test_args_env_and_output_are_forwarded(spark):
    def fn(prefix, suffix=""):
        rank = os.environ["HVD_SPARK_RANK"]
        print(f"{prefix} rank={rank} value={os.environ['HVD_TEST_VALUE']}{suffix}")
        print(f"warning from {rank}", file=sys.stderr)
        return int(rank) * 10

    out, err = io.StringIO(), io.StringIO()
    results = hvd_spark.run(fn, args=("hello",), kwargs={"suffix": "!"}, num_proc=2,
                            env={"HVD_TEST_VALUE": "42"}, stdout=out, stderr=err)
    assert results == [0, 10]
    assert "[0] hello rank=0 value=42!" in out.getvalue().splitlines()
    assert "[1] hello rank=1 value=42!" in out.getvalue().splitlines()
    assert "[1] warning from 1" in err.getvalue().splitlines()


def test_a_rank_raising_names_rank_host_and_traceback(spark):
    marker = f"hvd-test-{uuid.uuid4().hex}"

    def fn():
        if os.environ["HVD_SPARK_RANK"] == "1":
            raise ValueError("bad batch on purpose")
        time.sleep(60)  # must be stopped by the driver, not waited for

    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        hvd_spark.run(fn, num_proc=2, env={"HVD_TEST_MARKER": marker},
                      stdout=io.StringIO(), stderr=io.StringIO())
    assert time.monotonic() - started < 30
    root = info.value.root_cause
    assert root.rank == 1 and root.host
    assert "ValueError: bad batch on purpose" in str(info.value)
    assert "in fn" in root.traceback and "Traceback" in root.traceback
    assert f"rank 1 on host {root.host}" in str(info.value)
    assert _wait_no_marker(marker) == []


def test_a_rank_killed_mid_allreduce_fails_fast_without_orphans(spark):
    marker = f"hvd-test-{uuid.uuid4().hex}"

    def fn():
        import signal

        import numpy as np

        import hvd_spark.collectives as hvd

        hvd.init()
        hvd.allreduce(np.ones(4))
        if hvd.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            hvd.allreduce(np.ones(4))

    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        hvd_spark.run(fn, num_proc=2, env={"HVD_TEST_MARKER": marker},
                      stdout=io.StringIO(), stderr=io.StringIO())
    elapsed = time.monotonic() - started
    assert elapsed < 20, f"took {elapsed:.1f} s to notice a killed rank"
    assert info.value.root_cause.rank == 1
    assert "signal 9" in info.value.root_cause.message
    assert _wait_no_marker(marker) == []
    # The session is still usable afterwards.
    assert hvd_spark.run(lambda: "ok", num_proc=2, stdout=io.StringIO()) == ["ok", "ok"]


def test_num_proc_larger_than_slots_fails_before_launching(spark):
    started = time.monotonic()
    with pytest.raises(ConfigError, match="num_proc=3"):
        hvd_spark.run(lambda: 1, num_proc=3)
    assert time.monotonic() - started < 5


def test_unpicklable_fn_args_and_result_are_named(spark):
    lock = threading.Lock()
    with pytest.raises(ConfigError, match="^fn cannot be pickled"):
        hvd_spark.run(lambda: lock.locked(), num_proc=1)
    with pytest.raises(ConfigError, match="^args cannot be pickled"):
        hvd_spark.run(lambda x: 1, args=(threading.Lock(),), num_proc=1)
    with pytest.raises(WorkerFailedError, match="return value of fn on rank 0"):
        hvd_spark.run(lambda: threading.Lock(), num_proc=1, stdout=io.StringIO())


def test_two_concurrent_runs_do_not_interfere(spark):
    results: dict[str, list] = {}
    errors: list[BaseException] = []

    def fn():
        time.sleep(0.5)
        return os.environ["HVD_TEST_NAME"], os.environ["HVD_SPARK_SIZE"]

    def call(name: str) -> None:
        try:
            results[name] = hvd_spark.run(fn, num_proc=1, env={"HVD_TEST_NAME": name},
                                          stdout=io.StringIO(), start_timeout=120)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors
    assert results == {"a": [("a", "1")], "b": [("b", "1")]}


def test_without_a_spark_session_the_error_says_what_to_do():
    code = "import hvd_spark\nhvd_spark.run(lambda: 1, num_proc=1)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0
    assert "ConfigError" in proc.stderr and "active SparkSession" in proc.stderr
