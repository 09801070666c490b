"""The namespace hosts themselves: isolation, reachability, shaping and teardown."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from netns_cluster import hosts as netns_hosts
from netns_cluster.hosts import LinkShape, NetnsHosts
from tests.multihost.conftest import require_namespaces


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _links() -> set[str]:
    return set(os.listdir("/sys/class/net"))


_PROBE = """
import socket, sys, os
peer = sys.argv[1]
print(socket.gethostname(), os.listdir("/dev/shm"))
if peer:
    s = socket.create_connection((peer, 22222), timeout=10)
    s.sendall(b"hello"); s.close()
else:
    srv = socket.create_server(("0.0.0.0", 22222)); srv.settimeout(20)
    conn, _ = srv.accept(); print(conn.recv(5).decode())
"""


def test_hosts_have_own_names_shm_and_reach_each_other(bare_hosts):
    net = bare_hosts(2, shape=LinkShape(bandwidth="1gbit"))
    # Something in the root namespace's /dev/shm must not be seen on a host.
    with open("/dev/shm/hvd_harness_probe", "w"):
        pass
    try:
        server = subprocess.Popen(net.argv(0, [sys.executable, "-c", _PROBE, ""]),
                                  stdout=subprocess.PIPE, text=True)
        client = None
        for _ in range(50):  # until the server listens
            client = net.run(1, [sys.executable, "-c", _PROBE, net.addrs[0]])
            if client.returncode == 0:
                break
        out, _ = server.communicate(timeout=30)
    finally:
        os.unlink("/dev/shm/hvd_harness_probe")
    assert client is not None and client.returncode == 0, client.stderr
    assert out.split("\n")[0] == "hvdhost1 []" and out.split("\n")[1] == "hello"
    assert client.stdout.startswith("hvdhost2 []")
    qdisc = subprocess.run(["tc", "qdisc", "show", "dev", net.veths[0]], capture_output=True,
                           text=True, timeout=10).stdout
    assert "tbf" in qdisc and "rate 1Gbit" in qdisc


def _kernel_has_netem() -> bool:
    probe = subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us"],
                           capture_output=True, text=True, timeout=10)
    if probe.returncode == 0:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], timeout=10)
    return probe.returncode == 0


def test_a_delay_is_netem_or_a_clear_error(bare_hosts):
    shape = LinkShape(bandwidth="10gbit", delay="100us")
    if _kernel_has_netem():
        net = bare_hosts(1, shape=shape)
        qdisc = subprocess.run(["tc", "qdisc", "show", "dev", net.veths[0]],
                               capture_output=True, text=True, timeout=10).stdout
        assert "netem" in qdisc and "delay 100us" in qdisc
    else:
        with pytest.raises(netns_hosts.HarnessError, match="no netem qdisc.*delay"):
            bare_hosts(1, shape=shape)


def test_everything_is_removed_also_when_the_body_fails():
    require_namespaces()
    net = NetnsHosts(2)
    with pytest.raises(RuntimeError), net:
        assert set(net.namespaces) <= _namespaces() and net.bridge in _links()
        raise RuntimeError("test body failed")
    assert not set(net.namespaces) & _namespaces()
    assert net.bridge not in _links() and not set(net.veths) & _links()
    assert not any(os.path.exists(f"/etc/netns/{ns}") for ns in net.namespaces)


def test_namespaces_of_a_dead_process_are_removed_on_the_next_start(bare_hosts):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{netns_hosts.NS_PREFIX}{dead.pid}-0"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    try:
        bare_hosts(1)
        assert stale not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=10)


def test_bad_host_count_is_a_config_error():
    from hvd_spark.errors import ConfigError

    with pytest.raises(ConfigError, match="hosts must be between 1 and 200"):
        NetnsHosts(0)
    with pytest.raises(ConfigError, match="bandwidth '1gb' is not a rate"):
        LinkShape(bandwidth="1gb")
    with pytest.raises(ConfigError, match="delay '100' is not a time"):
        LinkShape(delay="100")
