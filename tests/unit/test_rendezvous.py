"""Rank assignment (pure) and the driver service's registration, without Spark."""

from __future__ import annotations

import io
import threading

import pytest

from hvd_spark import _env
from hvd_spark.collectives.tcp import wire
from hvd_spark.collectives.tcp.store import StoreClient
from hvd_spark.errors import ConfigError, DataError, RendezvousTimeoutError
from hvd_spark.runner.output import OutputForwarder
from hvd_spark.runner.rendezvous import TaskSlot, assign_ranks
from hvd_spark.runner.spark.driver_service import REGISTER, SHARE_ROWS, DriverService
from hvd_spark.runner.spark.spark_task import TaskSpec, child_env


def _table(slots):
    info = assign_ranks(slots)
    return {p: (i.host, i.rank, i.local_rank, i.local_size, i.cross_rank, i.cross_size)
            for p, i in info.items()}


def test_one_host_ranks_follow_partitions():
    table = _table([TaskSlot(1, "a"), TaskSlot(0, "a"), TaskSlot(2, "a")])
    assert table == {0: ("a", 0, 0, 3, 0, 1), 1: ("a", 1, 1, 3, 0, 1), 2: ("a", 2, 2, 3, 0, 1)}


def test_ranks_are_grouped_by_host_in_order_of_lowest_partition():
    # Interleaved partitions: host b owns partition 0, so its ranks come first.
    slots = [TaskSlot(0, "b"), TaskSlot(1, "a"), TaskSlot(2, "b"), TaskSlot(3, "a")]
    table = _table(slots)
    assert table == {
        0: ("b", 0, 0, 2, 0, 2),
        2: ("b", 1, 1, 2, 0, 2),
        1: ("a", 2, 0, 2, 1, 2),
        3: ("a", 3, 1, 2, 1, 2),
    }


def test_uneven_hosts_cross_ranks_count_hosts_with_that_local_rank():
    slots = [TaskSlot(0, "x"), TaskSlot(1, "x"), TaskSlot(2, "x"), TaskSlot(3, "y"),
             TaskSlot(4, "z"), TaskSlot(5, "z")]
    info = assign_ranks(slots)
    assert [info[p].rank for p in range(6)] == [0, 1, 2, 3, 4, 5]
    # local_rank 0 exists on x, y, z; 1 on x, z; 2 only on x.
    assert [(info[p].cross_rank, info[p].cross_size) for p in range(6)] == [
        (0, 3), (0, 2), (0, 1), (1, 3), (2, 3), (1, 2)]
    assert {info[p].local_size for p in (0, 1, 2)} == {3}
    assert info[3].local_size == 1 and info[5].local_size == 2
    assert all(i.size == 6 for i in info.values())


def test_every_rank_is_assigned_once():
    slots = [TaskSlot(p, f"h{p % 3}") for p in range(10)]
    info = assign_ranks(slots)
    assert sorted(i.rank for i in info.values()) == list(range(10))


def test_bad_registrations_are_rejected():
    with pytest.raises(ConfigError, match="no task"):
        assign_ranks([])
    with pytest.raises(ConfigError, match="twice"):
        assign_ranks([TaskSlot(0, "a"), TaskSlot(0, "b")])


def test_child_env_sets_the_rank_and_keeps_the_executor_and_user_variables():
    spec = TaskSpec(driver_addr="10.0.0.1:5000", secret=b"k" * 32, start_timeout_s=30.0,
                    heartbeat_s=10.0, env={"USER_VAR": "1"}, use_gpu=True, run_id="run1")
    info = assign_ranks([TaskSlot(0, "a"), TaskSlot(1, "b")])[1]
    env = child_env({"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1"}, spec, info, ["1"])
    assert env["PATH"] == "/bin" and env["USER_VAR"] == "1"
    assert env[_env.RANK] == "1" and env[_env.SIZE] == "2" and env[_env.CROSS_RANK] == "1"
    assert env[_env.RENDEZVOUS_ADDR] == "10.0.0.1:5000"
    assert bytes.fromhex(env[_env.SECRET]) == b"k" * 32
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert env[_env.START_TIMEOUT] == "30.0"


def test_driver_service_assigns_ranks_once_everyone_registered():
    secret = b"s" * 32
    output = OutputForwarder(io.StringIO(), io.StringIO())
    with DriverService(3, secret, "127.0.0.1", "127.0.0.1", output) as service:
        replies = {}

        def register(partition: int, host: str) -> None:
            client = StoreClient(wire.parse_addr(service.addr), secret, 5.0)
            try:
                replies[partition] = client.call(REGISTER, partition, host, 5.0, timeout=5.0)
            finally:
                client.close()

        threads = [threading.Thread(target=register, args=(p, h))
                   for p, h in ((2, "b"), (0, "a"), (1, "b"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert {p: i.rank for p, i in replies.items()} == {0: 0, 1: 1, 2: 2}
        assert service.hosts == {0: "a", 1: "b", 2: "b"}
        assert service.all_registered_at is not None


def _share_rows_reader(service: DriverService, secret: bytes,
                       timeout: float = 10.0) -> tuple[threading.Thread, dict]:
    """A rank asking the driver for the smallest share, as its worker does (it blocks)."""
    from hvd_spark.runner.worker import _launcher_min_rows

    got: dict = {}

    def ask() -> None:
        try:
            got["rows"] = _launcher_min_rows(wire.parse_addr(service.addr), secret, timeout)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            got["error"] = exc

    thread = threading.Thread(target=ask)
    thread.start()
    return thread, got


def _report_share(service: DriverService, secret: bytes, partition: int, rows: int) -> None:
    """A task telling the driver its share is on disk, as ``spark_task`` does."""
    client = StoreClient(wire.parse_addr(service.addr), secret, 5.0)
    try:
        client.call(SHARE_ROWS, partition, rows, timeout=5.0)
    finally:
        client.close()


def test_ranks_learn_the_smallest_share_once_every_task_wrote_its_own():
    secret = b"s" * 32
    output = OutputForwarder(io.StringIO(), io.StringIO())
    with DriverService(2, secret, "127.0.0.1", "127.0.0.1", output) as service:
        thread, got = _share_rows_reader(service, secret)
        _report_share(service, secret, 1, 700)
        thread.join(0.5)
        assert thread.is_alive() and not got  # one share is still being written
        _report_share(service, secret, 0, 650)
        thread.join(10)
        assert got == {"rows": 650}


def test_an_empty_share_fails_the_ranks_reading_with_its_partition_named():
    secret = b"s" * 32
    output = OutputForwarder(io.StringIO(), io.StringIO())
    with DriverService(2, secret, "127.0.0.1", "127.0.0.1", output) as service:
        thread, got = _share_rows_reader(service, secret)
        _report_share(service, secret, 0, 5)
        _report_share(service, secret, 1, 0)
        thread.join(10)
        assert isinstance(got.get("error"), DataError)
        assert "partitions [1] are empty" in str(got["error"])


def test_shares_not_written_within_the_start_timeout_are_named_as_such():
    secret = b"s" * 32
    output = OutputForwarder(io.StringIO(), io.StringIO())
    with DriverService(2, secret, "127.0.0.1", "127.0.0.1", output) as service:
        thread, got = _share_rows_reader(service, secret, timeout=0.5)
        _report_share(service, secret, 0, 5)  # the other task is still writing
        thread.join(10)
        assert isinstance(got.get("error"), RendezvousTimeoutError)
        assert "did not finish writing the ranks' shares" in str(got["error"])
        assert "HVD_SPARK_START_TIMEOUT" in str(got["error"])
