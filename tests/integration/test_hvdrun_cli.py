"""hvdrun's command line and the package's metadata, with real processes and a real wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import hvd_spark

REPO = Path(__file__).resolve().parents[2]
SECRET_HEX = "ab" * 32


def _hvdrun(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hvd_spark.runner", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_version():
    proc = _hvdrun("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"hvdrun (hvd_spark) {hvd_spark.__version__}"


@pytest.mark.parametrize("program, code, says", [
    ("no-such-command-hvd", 127, "no-such-command-hvd: command not found on PATH"),
    ("./no/such/file.py", 127, "./no/such/file.py: no such file"),
])
def test_missing_command_is_one_line(program, code, says):
    proc = _hvdrun("-np", "2", program, "arg")
    assert proc.returncode == code
    assert proc.stderr == f"hvdrun: cannot run {says}\n"
    assert proc.stdout == ""


def test_not_executable_file_is_one_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    proc = _hvdrun("-np", "2", str(script))
    assert proc.returncode == 126
    assert proc.stderr == f"hvdrun: cannot run {script}: not an executable file\n"


def test_root_cause_ranks_exit_code_is_hvdruns(tmp_path):
    script = tmp_path / "exit.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['HVD_SPARK_RANK'] == '1':\n"
        "    sys.exit(7)\n"
        "time.sleep(60)\n"
    )
    proc = _hvdrun("-np", "3", sys.executable, str(script))
    assert proc.returncode == 7, proc.stderr
    assert "root cause: rank 1" in proc.stderr and "exited with code 7" in proc.stderr


def test_rank_killed_by_signal_exits_128_plus_signal(tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(
        "import os, signal, time\n"
        "if os.environ['HVD_SPARK_RANK'] == '0':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n"
    )
    proc = _hvdrun("-np", "2", sys.executable, str(script))
    assert proc.returncode == 128 + 9, proc.stderr
    assert "root cause: rank 0" in proc.stderr and "killed by signal 9" in proc.stderr


def test_uncaught_exception_exits_1(tmp_path):
    script = tmp_path / "raise.py"
    script.write_text("raise SystemExit('bad input')\n")
    proc = _hvdrun("-np", "1", sys.executable, str(script))
    assert proc.returncode == 1
    assert "[0] bad input" in proc.stderr


def test_start_timeout_and_timeout_reach_the_ranks_apart(tmp_path):
    # horovodrun's --start-timeout: the start's deadline, apart from the collectives'.
    script = tmp_path / "timeouts.py"
    script.write_text("import os\n"
                      "env = os.environ\n"
                      "print(env['HVD_SPARK_START_TIMEOUT'], env['HVD_SPARK_TIMEOUT'])\n")
    proc = _hvdrun("-np", "2", "--timeout", "30", "--start-timeout", "90", sys.executable,
                   str(script))
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0] 90.0 30.0", "[1] 90.0 30.0"]
    bad = _hvdrun("-np", "2", "--start-timeout", "0", sys.executable, str(script))
    assert bad.returncode == 2 and "--start-timeout must be positive seconds" in bad.stderr


def test_bench_help_exits_0():
    proc = subprocess.run([sys.executable, "-m", "hvd_spark.bench", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m hvd_spark.bench <benchmark>")
    assert "allreduce" in proc.stdout
    unknown = subprocess.run([sys.executable, "-m", "hvd_spark.bench", "nope"],
                             capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "unknown benchmark 'nope'" in unknown.stderr


@pytest.mark.parametrize("variable, value, says", [
    ("HVD_SPARK_RANK", "one", "HVD_SPARK_RANK='one' is not an integer"),
    ("HVD_SPARK_SECRET", "xyz", "HVD_SPARK_SECRET is not hex-encoded"),
    ("HVD_SPARK_RENDEZVOUS_ADDR", "nohost",
     "HVD_SPARK_RENDEZVOUS_ADDR='nohost' is not of the form host:port"),
])
def test_rank_process_names_malformed_launcher_variable(variable, value, says):
    env = {**os.environ, "HVD_SPARK_RANK": "0", "HVD_SPARK_SIZE": "2",
           "HVD_SPARK_RENDEZVOUS_ADDR": "127.0.0.1:9", "HVD_SPARK_SECRET": SECRET_HEX,
           variable: value}
    proc = subprocess.run([sys.executable, "-m", "hvd_spark.runner.worker"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"hvd_spark.errors.ConfigError: {says}" in proc.stderr


def test_init_names_malformed_rendezvous_address():
    env = {**os.environ, "HVD_SPARK_RANK": "0", "HVD_SPARK_SIZE": "2",
           "HVD_SPARK_RENDEZVOUS_ADDR": "127.0.0.1", "HVD_SPARK_SECRET": SECRET_HEX}
    code = ("import hvd_spark.collectives as hvd\n"
            "from hvd_spark.errors import ConfigError\n"
            "try:\n    hvd.init()\nexcept ConfigError as exc:\n    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert "HVD_SPARK_RENDEZVOUS_ADDR='127.0.0.1' is not of the form host:port" in proc.stdout


def test_wheel_ships_py_typed_and_the_license(tmp_path):
    # Build from a copy so the checkout gets no build/ or egg-info of ours.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "hvd_spark", src / "hvd_spark",
                    ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
         str(src), "-w", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("hvd_spark-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = zf.read(metadata).decode()
        license_file = next(n for n in names if n.endswith("licenses/LICENSE"))
        license_text = zf.read(license_file).decode()
    assert "hvd_spark/py.typed" in names
    assert "License-Expression: Apache-2.0" in meta.splitlines()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
