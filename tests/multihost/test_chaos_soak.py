"""A short chaos soak (``python -m hvd_spark.bench chaos``) on 3 namespace hosts.

A few seeded faults per workload on one standalone cluster: the elastic loop must reach
its step count with the same state on every rank, DDP jobs through the distributor must
end fast with a named error and leave nothing running, and no host may keep a rank
process, a /dev/shm file or a listening port. The long soak (20+ faults) is the bench.
"""

from __future__ import annotations

import pytest

from hvd_spark.bench.chaos import faults, hostprocs
from hvd_spark.bench.chaos.soak import SPARK_CONF, soak
from netns_cluster import services as netns_services
from tests.multihost.conftest import require_namespaces

# Each soak has its own deadline (a failure, not a hang); on a loaded 2-core machine a
# soak of 3 faults with its recoveries can pass pytest's default of 300 s.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def chaos_cluster():
    require_namespaces()
    with netns_services.spark_cluster(3, cores=1, conf=SPARK_CONF) as (net, spark):
        yield net, spark


def _check(result, count: int) -> None:
    table = "\n".join(str(r) for r in result.rows)
    assert not result.problems, f"{result.problems}\n{table}\n{result.notes}"
    assert len(result.rows) == count, table
    for row in result.rows:
        # Every fault either stalled nothing, or training went on / the job ended.
        assert row.went_on is not None or row.ended, table


def test_an_elastic_loop_survives_a_stop_in_a_recovery(chaos_cluster):
    net, spark = chaos_cluster
    kinds = ["rank-kill", "executor-kill", "rank-stop", "link-down"]
    # Seed 3: an executor killed, a rank stopped for 20 s while the ring re-forms after
    # it, then a link cut for 5 s. (Before the fix of test_run_elastic_spark's
    # test_ranks_killed_one_after_another_are_replaced_by_new_attempts, the stopped
    # rank's task ended for good, and the run failed below min_np.)
    result = soak(net, spark, "elastic", 3, seed=3, deadline_s=600, kinds=kinds)
    _check(result, 3)
    killed = [r for r in result.rows if r.fault.kind in ("rank-kill", "rank-stop")]
    assert killed and all(r.detected is not None and r.detected < 30 for r in killed), \
        result.rows


def test_ddp_jobs_through_the_distributor_end_with_the_cause(chaos_cluster):
    net, spark = chaos_cluster
    result = soak(net, spark, "distributor", 2, seed=1, deadline_s=600,
                  kinds=["rank-kill", "executor-kill"])
    _check(result, 2)
    for row in result.rows:
        assert row.ended and ("signal 9" in row.ended or "lost" in row.ended), row


def _write_shm(net, i: int):
    """Write 1 MB into host ``i``'s /dev/shm as its processes see it (and remove it)."""
    import subprocess

    pid = hostprocs.worker_pid(net, i)
    return subprocess.run(
        ["nsenter", "-t", str(pid), "-m", "--", "sh", "-c",
         "head -c 1048576 /dev/zero > /dev/shm/probe; status=$?; rm -f /dev/shm/probe; "
         "exit $status"], capture_output=True, text=True, timeout=30)


def test_a_full_shm_is_one_hosts_own(chaos_cluster):
    """The /dev/shm fault fills one host's tmpfs, not the machine's or another host's."""
    import random

    net, _ = chaos_cluster
    fault = faults.fill_shm(net, random.Random(0))
    full = net.hostnames.index(fault.where)
    try:
        written = _write_shm(net, full)
        assert written.returncode != 0 and "No space" in written.stderr, written
        for i in range(net.count):
            if i != full:
                assert hostprocs.FILL_NAME not in hostprocs.shm_files(net, i)
                assert _write_shm(net, i).returncode == 0
    finally:
        fault.undo()
    assert hostprocs.FILL_NAME not in hostprocs.shm_files(net, full)
    assert _write_shm(net, full).returncode == 0
