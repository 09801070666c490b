"""The elastic driver's membership rules, driven directly (workers are threads calling join)."""

from __future__ import annotations

import threading
import time

import pytest

from hvd_spark.errors import ConfigError, ElasticJobError
from hvd_spark.runner.elastic.elastic_driver import ElasticDriver, ElasticSettings
from tests.waiting import wait_until


def _settings(**kw) -> ElasticSettings:
    base = dict(num_proc=3, min_np=2, max_np=3, start_timeout=5, elastic_timeout=2,
                heartbeat_s=0)
    base.update(kw)
    return ElasticSettings(**base)


def _join_all(driver: ElasticDriver, joins: list[tuple[str, str, int]]) -> dict:
    """Join several workers concurrently; return worker -> assignment or exception."""
    out: dict = {}

    def one(worker, host, last):
        try:
            out[worker] = driver.join(worker, host, last)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out[worker] = exc

    threads = [threading.Thread(target=one, args=j) for j in joins]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


class _Events:
    """The driver's event lines, and an Event set when a newcomer waits to join (the driver
    reports it before its join waits, holding its lock: no sleep needed to order the two)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.newcomer_waits = threading.Event()

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        if "is waiting to join" in line:
            self.newcomer_waits.set()

    def __iter__(self):
        return iter(self.lines)


@pytest.fixture
def driver():
    events = _Events()
    d = ElasticDriver(_settings(), on_event=events)
    d.events = events
    yield d
    d.close()


def test_first_generation_groups_ranks_by_host(driver):
    got = _join_all(driver, [("a", "h1", 0), ("b", "h2", 0), ("c", "h1", 0)])
    assert {w: (g["generation"], g["rank"], g["local_rank"], g["cross_size"])
            for w, g in got.items()} == {"a": (1, 0, 0, 2), "c": (1, 1, 1, 1),
                                         "b": (1, 2, 0, 2)}


def test_a_lost_worker_breaks_the_ring_and_survivors_keep_their_order(driver):
    _join_all(driver, [("a", "h", 0), ("b", "h", 0), ("c", "h", 0)])
    driver.worker_lost("a", "exited with code -9")
    assert driver.beat("b", 1) == "rank 0 (worker a on h) exited with code -9"
    got = _join_all(driver, [("b", "h", 1), ("c", "h", 1)])
    assert {w: (g["generation"], g["rank"], g["size"]) for w, g in got.items()} == {
        "b": (2, 0, 2), "c": (2, 1, 2)}
    assert driver.beat("b", 2) is None
    assert any("generation 2: 2 ranks" in e for e in driver.events)
    with pytest.raises(ElasticJobError, match="declared lost"):
        driver.join("a", "h", 1)


def test_a_newcomer_raises_the_version_and_joins_at_the_next_reset(driver):
    driver.settings = _settings(num_proc=2)
    _join_all(driver, [("a", "h", 0), ("b", "h", 0)])
    assert driver.current_version() == 0
    late: dict = {}
    t = threading.Thread(target=lambda: late.setdefault("c", driver.join("c", "h", 0)))
    t.start()
    assert driver.events.newcomer_waits.wait(5)
    assert driver.current_version() == 1  # the ranks' next commit sees it
    got = _join_all(driver, [("a", "h", 1), ("b", "h", 1)])
    t.join(10)
    assert got["a"]["rank"] == 0 and got["b"]["rank"] == 1 and late["c"]["rank"] == 2
    assert late["c"]["generation"] == 2 and late["c"]["size"] == 3


def test_too_few_left_after_the_elastic_timeout_is_fatal_and_names_the_loss(driver):
    _join_all(driver, [("a", "h", 0), ("b", "h", 0), ("c", "h", 0)])
    driver.worker_lost("a", "exited with code -9")
    driver.worker_lost("b", "sent no heartbeat for 10 s")
    got = _join_all(driver, [("c", "h", 1)])
    assert isinstance(got["c"], ElasticJobError)
    message = str(got["c"])
    assert "fewer than min_np=2" in message and "exited with code -9" in message
    assert "sent no heartbeat" in message


def test_the_reset_limit_is_enforced():
    d = ElasticDriver(_settings(reset_limit=0))
    try:
        _join_all(d, [("a", "h", 0), ("b", "h", 0), ("c", "h", 0)])
        d.worker_lost("c", "exited with code 1")
        got = _join_all(d, [("a", "h", 1), ("b", "h", 1)])
        assert all("reset_limit=0" in str(v) for v in got.values())
    finally:
        d.close()


def test_a_straggler_is_dropped_after_the_elastic_timeout(driver):
    _join_all(driver, [("a", "h", 0), ("b", "h", 0), ("c", "h", 0)])
    started = time.monotonic()
    # c never rejoins (stuck without a heartbeat limit): a and b go on without it.
    got = _join_all(driver, [("a", "h", 1), ("b", "h", 1)])
    assert 1.5 < time.monotonic() - started < 10
    assert {g["size"] for g in got.values()} == {2}
    assert "did not rejoin" in driver.lost["c"]


def test_a_silent_worker_is_declared_lost_by_the_heartbeat():
    lost: list[tuple[str, str]] = []
    d = ElasticDriver(_settings(heartbeat_s=0.5), on_lost=lambda w, r: lost.append((w, r)))
    try:
        _join_all(d, [("a", "h", 0), ("b", "h", 0), ("c", "h", 0)])

        def a_and_b_beat() -> list:  # every check: a and b are alive, c says nothing
            d.beat("a", 1)
            d.beat("b", 1)
            return lost

        wait_until(a_and_b_beat, timeout=3, what="c declared lost")
        assert lost[0][0] == "c" and "no heartbeat" in lost[0][1]
    finally:
        d.close()


@pytest.mark.parametrize("kw, match", [
    (dict(min_np=4), "min_np <= num_proc <= max_np"),
    (dict(max_np=2), "min_np <= num_proc <= max_np"),
    (dict(num_proc=0), "num_proc must be a positive integer"),
    (dict(reset_limit=-1), "reset_limit"),
    (dict(elastic_timeout=0), "elastic_timeout"),
])
def test_bad_settings_are_refused_with_the_parameter(kw, match):
    with pytest.raises(ConfigError, match=match):
        _settings(**kw)


def _join_in_background(driver: ElasticDriver, events: _Events, worker: str, last: int):
    out: dict = {}

    def one():
        started = time.monotonic()
        try:
            out["result"] = driver.join(worker, "h", last)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out["result"] = exc
        out["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=one)
    thread.start()
    assert events.newcomer_waits.wait(5), "the newcomer's join never reached its wait"
    return thread, out


@pytest.mark.parametrize("end", ["finished", "closed"])
def test_a_join_waiting_when_the_job_ends_returns_at_once(end):
    # A newcomer waits for the members' next commit; the job ends first. Its join (and
    # the store connection serving it) must not wait out the 60 s start timeout.
    events = _Events()
    d = ElasticDriver(_settings(num_proc=2, max_np=3, start_timeout=60, elastic_timeout=60),
                      on_event=events)
    try:
        _join_all(d, [("a", "h", 0), ("b", "h", 0)])
        thread, out = _join_in_background(d, events, "c", 0)
        assert "result" not in out  # still waiting for a place
        if end == "finished":
            d.worker_exited("a", 0)  # a member finished training: the job is done
        else:
            d.close()
        thread.join(5)
        assert not thread.is_alive()
        assert isinstance(out["result"], ElasticJobError), out
        assert "finished" in str(out["result"]) or "stopped" in str(out["result"])
        assert out["seconds"] < 3
    finally:
        d.close()


def test_started_workers_slower_to_init_than_the_start_timeout_still_form_the_ring():
    """Issue 47: as in Horovod, the start timeout bounds the workers' start, not their
    processes' imports before init(); started workers get the elastic timeout on top."""
    d = ElasticDriver(_settings(num_proc=2, min_np=2, max_np=2, start_timeout=0.3,
                                elastic_timeout=10))
    try:
        d.worker_started("a", "h")
        d.worker_started("b", "h")
        time.sleep(0.8)  # the start timeout has passed while both were importing
        got = _join_all(d, [("a", "h", 0), ("b", "h", 0)])
        assert {w: (g["generation"], g["size"]) for w, g in got.items()} == {
            "a": (1, 2), "b": (1, 2)}, got
    finally:
        d.close()


def test_too_few_workers_started_within_the_start_timeout_is_fatal():
    d = ElasticDriver(_settings(num_proc=3, min_np=3, max_np=3, start_timeout=0.3,
                                elastic_timeout=10))
    try:
        d.worker_started("a", "h")
        got = _join_all(d, [("a", "h", 0), ("b", "h", 0)])
        assert all(isinstance(e, ElasticJobError) for e in got.values()), got
        assert "only 2 of the 3 workers started within the start timeout of 0.3 s" in str(
            got["a"])
    finally:
        d.close()


def test_a_started_worker_that_never_calls_init_is_bounded_by_the_elastic_timeout():
    d = ElasticDriver(_settings(num_proc=2, min_np=2, max_np=2, start_timeout=0.2,
                                elastic_timeout=0.5))
    try:
        d.worker_started("a", "h")
        d.worker_started("b", "h")  # its process never reaches init()
        begun = time.monotonic()
        got = _join_all(d, [("a", "h", 0)])
        assert isinstance(got["a"], ElasticJobError), got
        assert ("only 1 of the 2 started workers called init() within the start timeout "
                "of 0.2 s and the elastic timeout of 0.5 s after it") in str(got["a"])
        assert time.monotonic() - begun < 5
    finally:
        d.close()
