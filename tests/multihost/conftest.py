"""Multi-host fixtures: Spark standalone clusters whose workers are network namespaces.

Each cluster is module-scoped (starting one costs about 30 s) and torn down after the
module, also when a test failed. Where namespaces cannot be made (not root, no iproute2)
the tests skip with that reason; CI runs as root with iproute2 installed and sets
HVD_TESTS_MULTIHOST=required, so there they run or fail.
"""

from __future__ import annotations

import os

import pytest

from netns_cluster import hosts as netns_hosts
from netns_cluster import services as netns_services

# .ci/run sets it: there, a machine without namespaces is a failure, not a skip.
REQUIRED = "HVD_TESTS_MULTIHOST"


def require_namespaces() -> None:
    """Skip (fail where REQUIRED=required) when namespaces cannot be made here."""
    why = netns_hosts.problem()
    if why and os.environ.get(REQUIRED) == "required":
        pytest.fail(f"{REQUIRED}=required but the multi-host harness cannot run: {why}")
    if why:
        pytest.skip(f"multi-host harness unavailable: {why}")


@pytest.fixture(scope="module", params=[(2, 2), (3, 1)], ids=["2hostsx2", "3hostsx1"])
def cluster(request):
    """``(hosts, spark, ranks_per_host)``: 2 hosts x 2 slots, then 3 hosts x 1 slot."""
    require_namespaces()
    count, cores = request.param
    with netns_services.spark_cluster(count, cores=cores) as (net, spark):
        yield net, spark, cores


@pytest.fixture
def bare_hosts():
    """A factory of started NetnsHosts (no Spark), all closed after the test."""
    require_namespaces()
    made: list[netns_hosts.NetnsHosts] = []

    def make(count: int, **kwargs) -> netns_hosts.NetnsHosts:
        net = netns_hosts.NetnsHosts(count, **kwargs).start()
        made.append(net)
        return net

    yield make
    for net in made:
        net.close()
