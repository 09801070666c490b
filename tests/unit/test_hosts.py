"""Horovod's host syntax: -H lists, hostfiles, slot filling and the ssh command."""

from __future__ import annotations

import pytest

from hvd_spark.errors import ConfigError
from hvd_spark.runner.local import hosts
from hvd_spark.runner.local.hosts import HostSlots
from hvd_spark.runner.local.ssh_launcher import forwarded_env, ssh_argv


def test_parse_hosts():
    assert hosts.parse_hosts("a:2, b:1,c") == [HostSlots("a", 2), HostSlots("b", 1),
                                               HostSlots("c", 1)]
    with pytest.raises(ConfigError, match="names no host"):
        hosts.parse_hosts(" , ")
    with pytest.raises(ConfigError, match="entry 'a:x'.*positive integer"):
        hosts.parse_hosts("a:x")
    with pytest.raises(ConfigError, match="names host 'a' twice"):
        hosts.parse_hosts("a:1,a:2")


def test_parse_hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# cluster\nnode1 slots=4\n\nnode2   slots = 2  # gpu box\nnode3\n")
    assert hosts.parse_hostfile(str(path)) == [HostSlots("node1", 4), HostSlots("node2", 2),
                                               HostSlots("node3", 1)]
    path.write_text("node1 cpus=4\n")
    with pytest.raises(ConfigError, match="line 1: 'node1 cpus=4' is not 'hostname slots=N'"):
        hosts.parse_hostfile(str(path))
    path.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="names no host"):
        hosts.parse_hostfile(str(path))
    with pytest.raises(ConfigError, match="cannot read it"):
        hosts.parse_hostfile(str(tmp_path / "missing"))


def test_ranks_fill_hosts_in_order():
    placed = hosts.place_ranks([HostSlots("a", 2), HostSlots("b", 2), HostSlots("c", 1)], 4)
    assert [(i.rank, i.host, i.local_rank, i.local_size, i.cross_rank, i.cross_size)
            for i in placed] == [(0, "a", 0, 2, 0, 2), (1, "a", 1, 2, 0, 2),
                                 (2, "b", 0, 2, 1, 2), (3, "b", 1, 2, 1, 2)]
    with pytest.raises(ConfigError, match="-np 6 is more than the 5 slots"):
        hosts.place_ranks([HostSlots("a", 2), HostSlots("b", 3)], 6)


def test_ssh_never_prompts_and_secrets_are_not_forwarded(monkeypatch):
    monkeypatch.setenv("HVD_SPARK_SSH_OPTS", "-o LogLevel=ERROR")
    argv = ssh_argv("node1", 2222, "/keys/id")
    assert argv[0] == "ssh" and "BatchMode=yes" in argv and argv[-1] == "node1"
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-i") + 1] == "/keys/id"
    assert "LogLevel=ERROR" in argv
    env = forwarded_env({"PATH": "/bin", "HVD_SPARK_SECRET": "x", "HOROVOD_SECRET_KEY": "y",
                         "CUDA_VISIBLE_DEVICES": "0", "BASH_FUNC_f%%": "()",
                         "HVD_SPARK_TIMEOUT": "9", "HVD_SPARK_RANK": "3"})
    assert env == {"PATH": "/bin", "HVD_SPARK_TIMEOUT": "9"}


def test_hosts_with_mpi_or_elastic_options_are_refused():
    import argparse

    from hvd_spark.runner.local.ssh_launcher import host_slots_from

    base = {"hosts": "a:1", "hostfile": None, "mpi": False, "elastic": False}
    assert host_slots_from(argparse.Namespace(**base)) == [HostSlots("a", 1)]
    with pytest.raises(ConfigError, match="with --mpi give mpirun its hosts"):
        host_slots_from(argparse.Namespace(**{**base, "mpi": True}))
    with pytest.raises(ConfigError, match="elastic options"):
        host_slots_from(argparse.Namespace(**{**base, "elastic": True}))
    with pytest.raises(ConfigError, match="not both"):
        host_slots_from(argparse.Namespace(**{**base, "hostfile": "f"}))
