"""``hvdrun -H`` / ``--hostfile``: ranks started over ssh on namespace hosts running sshd."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from hvd_spark.runner.local.ssh_launcher import SSH_OPTS
from netns_cluster import hosts as netns_hosts
from netns_cluster import services as netns_services
from tests.multihost.conftest import require_namespaces

_SCRIPT = textwrap.dedent("""
    import os, socket, sys, time
    import numpy as np
    import hvd_spark.collectives as hvd
    from hvd_spark.collectives import _plumbing
    from hvd_spark.collectives.tcp.links import TcpLink

    hvd.init()
    r = hvd.rank()
    total = hvd.allreduce(np.full(1 << 18, float(r + 1)), op=hvd.Sum)
    links = _plumbing.current_engine().comm.links.values()
    peers = sorted(link.sock.getpeername()[0] for link in links if isinstance(link, TcpLink))
    print("RESULT", r, hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
          hvd.cross_size(), socket.gethostname(), float(total[0]), float(total[-1]),
          os.environ.get("MY_SETTING"), ",".join(peers) or "-", flush=True)
    if len(sys.argv) > 1 and r == int(sys.argv[1]):
        time.sleep(1)
        sys.exit(3)
    if len(sys.argv) > 1:
        time.sleep(120)  # until hvdrun stops this rank (the test allows far less)
""")


@pytest.fixture(scope="module")
def ssh_hosts():
    require_namespaces()
    workdir = tempfile.mkdtemp(prefix="hvd-ssh-")
    with netns_hosts.NetnsHosts(3) as net:
        net.add_network("data1")
        servers = netns_services.SshServers(net, workdir).start()
        try:
            script = os.path.join(workdir, "train.py")
            with open(script, "w") as f:
                f.write(_SCRIPT)
            yield net, servers, script
        finally:
            servers.close()
            subprocess.run(["rm", "-rf", workdir], timeout=30)


def _hvdrun(servers, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, SSH_OPTS: servers.client_opts, "MY_SETTING": "forwarded"}
    return subprocess.run(
        [sys.executable, "-m", "hvd_spark.runner", *args], capture_output=True, text=True,
        env=env, timeout=timeout)


def _results(stdout: str) -> dict[int, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        if "RESULT" in line:
            fields = line.split("RESULT", 1)[1].split()
            rows[int(fields[0])] = fields
            assert line.startswith(f"[{fields[0]}] "), line  # prefixed with its rank
    return rows


def test_hvdrun_h_starts_ranks_on_each_host(ssh_hosts):
    net, servers, script = ssh_hosts
    hosts = f"{net.addrs[0]}:2,{net.addrs[1]}:2"
    done = _hvdrun(servers, "-np", "4", "-H", hosts, "-i", servers.identity,
                   "--ssh-port", "22", sys.executable, script)
    assert done.returncode == 0, done.stderr
    rows = _results(done.stdout)
    assert sorted(rows) == [0, 1, 2, 3]
    want_total = float(sum(range(1, 5)))
    for r, f in rows.items():
        host = r // 2
        # size, local rank and size, cross rank and size, the host's own hostname
        assert f[1:7] == ["4", str(r % 2), "2", str(host), "2", net.hostnames[host]], f
        assert float(f[7]) == want_total and float(f[8]) == want_total
        assert f[9] == "forwarded"  # the launcher's environment reaches remote ranks
        # The other host is reached over its eth0 address.
        other = net.addrs[1 - host]
        assert other in f[10].split(","), f


def test_hostfile_and_network_interface(ssh_hosts, tmp_path):
    net, servers, script = ssh_hosts
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# three hosts\n" + "".join(f"{a} slots=1\n" for a in net.addrs))
    done = _hvdrun(servers, "-np", "3", "--hostfile", str(hostfile), "-i", servers.identity,
                   "--network-interface", "data1", sys.executable, script)
    assert done.returncode == 0, done.stderr
    rows = _results(done.stdout)
    data_addrs = set(net.interfaces["data1"])
    for r, f in rows.items():
        assert f[1:7] == ["3", "0", "1", str(r), "3", net.hostnames[r]], f
        peers = set(f[10].split(","))
        assert len(peers) == 2 and peers <= data_addrs, (peers, data_addrs)


def _leftovers(script: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", script], capture_output=True, text=True, timeout=10)
    return [line for line in out.stdout.splitlines() if "hvd_spark.runner -np" not in line]


def test_a_failed_rank_stops_every_remote_rank(ssh_hosts):
    net, servers, script = ssh_hosts
    hosts = f"{net.addrs[0]}:1,{net.addrs[1]}:1,{net.addrs[2]}:1"
    start = time.monotonic()
    done = _hvdrun(servers, "-np", "3", "-H", hosts, "-i", servers.identity, "--timeout", "60",
                   sys.executable, script, "2")
    took = time.monotonic() - start
    assert done.returncode == 3, done.stderr  # the failed rank's own exit code
    assert "root cause: rank 2 on host " + net.addrs[2] in done.stderr, done.stderr
    assert took < 45, took  # not the 60 s collective timeout: the others were stopped
    deadline = time.monotonic() + 10
    while _leftovers(script) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _leftovers(script) == []


def test_a_host_without_ssh_is_a_clear_error_before_anything_starts(ssh_hosts):
    net, servers, script = ssh_hosts
    start = time.monotonic()
    done = _hvdrun(servers, "-np", "2", "-H", f"{net.addrs[0]}:1,{net.addrs[1]}:1",
                   "-i", servers.identity, "-p", "2222", sys.executable, script)
    assert done.returncode == 2
    assert "cannot start ranks over ssh -p 2222 on 2 host(s)" in done.stderr, done.stderr
    assert net.addrs[0] in done.stderr and "RESULT" not in done.stdout
    assert time.monotonic() - start < 30
    done = _hvdrun(servers, "-np", "5", "-H", f"{net.addrs[0]}:2,{net.addrs[1]}:2",
                   sys.executable, script)
    assert done.returncode == 2 and "-np 5 is more than the 4 slots" in done.stderr


def test_this_machine_and_a_remote_host_in_one_job(ssh_hosts):
    net, servers, script = ssh_hosts
    done = _hvdrun(servers, "-np", "3", "-H", f"localhost:1,{net.addrs[0]}:2",
                   "-i", servers.identity, sys.executable, script)
    assert done.returncode == 0, done.stderr
    rows = _results(done.stdout)
    # Rank 0 runs here without ssh; the remote ranks reach it at the bridge's address.
    assert rows[0][1:7] == ["3", "0", "1", "0", "2", socket.gethostname()]
    assert [rows[r][6] for r in (1, 2)] == [net.hostnames[0]] * 2
    assert net.bridge_addr in rows[1][10].split(",")
    assert all(float(rows[r][7]) == 6.0 for r in rows)
