"""The ssh launcher keeps the ``Launcher`` contract, on two namespace hosts running sshd.

The checks are ``tests/contract/test_launcher_contract.py``'s; here each rank starts
over ssh on its own host.
"""

from __future__ import annotations

import subprocess
import tempfile

import pytest

from hvd_spark.runner.local.hosts import HostSlots, place_ranks
from hvd_spark.runner.local.ssh_launcher import SSH_OPTS, SshJob
from netns_cluster import hosts as netns_hosts
from netns_cluster import services as netns_services
from tests.contract.test_launcher_contract import CONFIG, NUM_PROC, LauncherContract
from tests.multihost.conftest import require_namespaces


@pytest.fixture(scope="module")
def ssh_servers():
    require_namespaces()
    workdir = tempfile.mkdtemp(prefix="hvd-ssh-contract-")
    with netns_hosts.NetnsHosts(NUM_PROC) as net:
        servers = netns_services.SshServers(net, workdir).start()
        try:
            yield net, servers
        finally:
            servers.close()
            subprocess.run(["rm", "-rf", workdir], timeout=30)


class TestSshLauncher(LauncherContract):
    @pytest.fixture
    def launcher(self, ssh_servers, monkeypatch):
        net, servers = ssh_servers
        monkeypatch.setenv(SSH_OPTS, servers.client_opts)
        placement = place_ranks([HostSlots(addr, 1) for addr in net.addrs], NUM_PROC)
        return lambda: SshJob(CONFIG, placement, ssh_identity=servers.identity)
