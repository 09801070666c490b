"""Choosing the MPI backend, building mpirun's command line, relabelling its output."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from hvd_spark.collectives import registry
from hvd_spark.runner.local import mpi_launcher
from hvd_spark.runner.output import OutputForwarder

_MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
_OURS = ("HVD_SPARK_RANK", "HVD_SPARK_SIZE", "HVD_SPARK_RENDEZVOUS_ADDR", "HVD_SPARK_SECRET")


@pytest.fixture
def clean_env(monkeypatch):
    for var in (*_MPI_VARS, *_OURS):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_auto_is_tcp_outside_mpirun(clean_env):
    assert not registry.launched_by_mpirun()
    assert registry.own_world("auto") is None
    assert registry.own_world("tcp") is None
    assert "mpi" in registry.names()


@pytest.mark.parametrize("var", _MPI_VARS)
def test_mpirun_is_recognised_by_its_variables(clean_env, var):
    clean_env.setenv(var, "2")
    assert registry.launched_by_mpirun()


def test_our_launchers_variables_win_over_an_mpi_allocation(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    clean_env.setenv("HVD_SPARK_RANK", "0")
    assert not registry.launched_by_mpirun()
    assert registry.own_world("auto") is None


def test_the_mpi_factory_refuses_to_join_a_tcp_mesh():
    from hvd_spark.errors import BackendUnavailableError

    factory = registry.resolve("mpi")
    with pytest.raises(BackendUnavailableError, match="hvdrun --mpi"):
        factory(None, None, {})


def test_open_mpi_command_line():
    mpirun = mpi_launcher.find_mpirun()
    assert mpi_launcher.implementation(mpirun) == mpi_launcher.OPEN_MPI
    args, env = mpi_launcher.mpirun_command(3, ["python", "t.py"], {"HVD_SPARK_TIMEOUT": "9"})
    assert args[:3] == [mpirun, "-np", "3"] and args[-2:] == ["python", "t.py"]
    assert "--oversubscribe" in args and "--tag-output" in args
    exported = {args[i + 1] for i, a in enumerate(args) if a == "-x"}
    assert {"HVD_SPARK_BACKEND", "HVD_SPARK_TIMEOUT"} <= exported
    assert env["HVD_SPARK_BACKEND"] == "mpi" and env["HVD_SPARK_TIMEOUT"] == "9"


def test_our_and_horovods_settings_are_exported_to_every_host(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1024")
    monkeypatch.setenv("HVD_SPARK_CYCLE_TIME", "2")
    monkeypatch.setenv("HVD_SPARK_RANK", "5")  # an enclosing job's: not forwarded
    args, env = mpi_launcher.mpirun_command(2, ["t"], {})
    exported = {args[i + 1] for i, a in enumerate(args) if a == "-x"}
    assert {"HOROVOD_FUSION_THRESHOLD", "HVD_SPARK_CYCLE_TIME"} <= exported
    assert "HVD_SPARK_RANK" not in exported


def test_mpich_command_line(tmp_path):
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\necho '    Version: 4.2.0'\n")
    fake.chmod(0o755)
    assert mpi_launcher.implementation(str(fake)) == mpi_launcher.MPICH
    args, _ = mpi_launcher.mpirun_command(2, ["t"], {}, mpirun=str(fake))
    assert "-prepend-rank" in args and "--oversubscribe" not in args
    i = args.index("-genv")
    assert args[i : i + 3] == ["-genv", "HVD_SPARK_BACKEND", "mpi"]


def test_an_unknown_mpirun_is_a_config_error(tmp_path):
    from hvd_spark.errors import ConfigError

    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'Some Other MPI 1.0'\n")
    fake.chmod(0o755)
    with pytest.raises(ConfigError, match="neither Open MPI nor MPICH"):
        mpi_launcher.mpirun_command(2, ["t"], {}, mpirun=str(fake))
    with pytest.raises(ConfigError, match="num_proc"):
        mpi_launcher.mpirun_command(0, ["t"], {}, mpirun=str(fake))


def test_tagged_output_becomes_rank_prefixed_lines(capsys):
    out = io.StringIO()
    forwarder = OutputForwarder(out, io.StringIO())
    pipe = io.BytesIO(b"[1,2]<stdout>: loss 0.5\n[3] mpich line\nmpirun's own words\n")
    mpi_launcher._relabel(pipe, "stdout", forwarder)
    assert out.getvalue() == "[2] loss 0.5\n[3] mpich line\n"
    assert capsys.readouterr().out == "mpirun's own words\n"


def test_hvdrun_refuses_mpi_with_elastic_options():
    proc = subprocess.run([sys.executable, "-m", "hvd_spark.runner", "--mpi", "-np", "2",
                           "--min-np", "1", "python", "-c", "pass"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--mpi cannot be combined with the elastic options" in proc.stderr


def test_build_queries_outside_an_mpi_job():
    # A fresh interpreter: asking (and resolving the backend) must not start MPI.
    code = ("import sys, hvd_spark.collectives as hvd\n"
            "from hvd_spark.collectives import registry\n"
            "registry.resolve('mpi')\n"
            "print(hvd.mpi_built(), hvd.mpi_enabled(), hvd.mpi_threads_supported(),\n"
            "      'mpi4py.MPI' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.split() == ["True", "False", "False", "False"], proc.stderr


def test_init_with_an_mpi_communicator_outside_mpirun_is_a_config_error():
    code = ("from mpi4py import MPI\n"
            "import hvd_spark.collectives as hvd\n"
            "from hvd_spark.errors import ConfigError\n"
            "try:\n"
            "    hvd.init(comm=MPI.COMM_WORLD)\n"
            "except ConfigError as exc:\n"
            "    print('refused:', exc)\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HVD_SPARK_", "OMPI_", "PMIX_", "PMI_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert "refused: init(comm=<MPI communicator>) needs ranks started by mpirun" in proc.stdout, (
        proc.stdout + proc.stderr)


def test_init_with_something_else_names_what_it_takes():
    import hvd_spark.collectives as hvd
    from hvd_spark.errors import ConfigError

    with pytest.raises(ConfigError, match="mpi4py communicator or a list of ranks, got object"):
        hvd.init(comm=object())
