"""Configuration objects fail early and name the variable; Horovod's names are honoured."""

from __future__ import annotations

import math
import os
import socket

import pytest

from hvd_spark.config import EngineConfig, WorldInfo, interface_address
from hvd_spark.errors import ConfigError

_FOREIGN = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Every test starts with no HVD_SPARK_* / HOROVOD_* / foreign launcher variable."""
    for var in list(os.environ):
        if var.startswith(("HVD_SPARK_", "HOROVOD_")) or var in _FOREIGN:
            monkeypatch.delenv(var)


def test_engine_config_from_env(monkeypatch):
    monkeypatch.setenv("HVD_SPARK_FUSION_THRESHOLD", "1024")
    monkeypatch.setenv("HVD_SPARK_CYCLE_TIME", "2.5")
    monkeypatch.setenv("HVD_SPARK_DISABLE_SHM", "1")
    cfg = EngineConfig.from_env()
    assert (cfg.fusion_threshold, cfg.cycle_time_ms, cfg.use_shm) == (1024, 2.5, False)


def test_engine_defaults_without_any_variable():
    cfg = EngineConfig.from_env()
    assert cfg == EngineConfig()
    assert (cfg.timeline_path, cfg.timeline_mark_cycles, cfg.timeline_dynamic) == ("", False, False)
    assert cfg.stall_shutdown == 0.0 and cfg.stall_warning == 60.0


def test_horovod_names_are_honoured(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", str(32 * 1024 * 1024))
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "3.5")
    monkeypatch.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", "45")
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "20")
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "90")
    monkeypatch.setenv("HOROVOD_TIMELINE", "/somewhere/timeline.json")
    monkeypatch.setenv("HOROVOD_TIMELINE_MARK_CYCLES", "1")
    cfg = EngineConfig.from_env()
    assert cfg.fusion_threshold == 32 * 1024 * 1024
    assert cfg.cycle_time_ms == 3.5
    assert cfg.timeout == 45.0
    assert (cfg.stall_warning, cfg.stall_shutdown) == (20.0, 90.0)
    assert cfg.timeline_path == "/somewhere/timeline.json"
    assert cfg.timeline_mark_cycles is True and cfg.timeline_dynamic is False


def test_hvd_spark_names_win_over_horovod(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1")
    monkeypatch.setenv("HVD_SPARK_FUSION_THRESHOLD", "2048")
    monkeypatch.setenv("HOROVOD_TIMELINE", "/from/horovod.json")
    monkeypatch.setenv("HVD_SPARK_TIMELINE", "/from/hvd_spark.json")
    monkeypatch.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", "5")
    monkeypatch.setenv("HVD_SPARK_TIMEOUT", "7")
    cfg = EngineConfig.from_env()
    assert (cfg.fusion_threshold, cfg.timeline_path, cfg.timeout) == (
        2048, "/from/hvd_spark.json", 7.0)


def test_timeline_dynamic_means_no_file_at_start(monkeypatch):
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")
    cfg = EngineConfig.from_env()
    assert (cfg.timeline_path, cfg.timeline_dynamic) == ("", True)


def test_stall_check_disable_turns_off_warning_and_shutdown(monkeypatch):
    monkeypatch.setenv("HOROVOD_STALL_CHECK_DISABLE", "1")
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "5")
    cfg = EngineConfig.from_env()
    assert math.isinf(cfg.stall_warning) and cfg.stall_shutdown == 0.0


def test_start_timeout_from_horovod(monkeypatch):
    from hvd_spark import _env

    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "33")
    assert _env.get_float(_env.START_TIMEOUT, 600.0) == 33.0
    monkeypatch.setenv("HOROVOD_SPARK_START_TIMEOUT", "44")
    assert _env.get_float(_env.START_TIMEOUT, 600.0) == 44.0
    monkeypatch.setenv("HVD_SPARK_START_TIMEOUT", "55")
    assert _env.get_float(_env.START_TIMEOUT, 600.0) == 55.0


@pytest.mark.parametrize("var,value,needle", [
    ("HVD_SPARK_TIMEOUT", "-1", "HVD_SPARK_TIMEOUT"),
    ("HVD_SPARK_TIMEOUT", "soon", "HVD_SPARK_TIMEOUT"),
    ("HVD_SPARK_CHUNK_BYTES", "12", "HVD_SPARK_CHUNK_BYTES"),
    ("HVD_SPARK_OUTPUT_POOL_BYTES", "-1", "HVD_SPARK_OUTPUT_POOL_BYTES"),
    ("HVD_SPARK_SPIN_US", "-1", "HVD_SPARK_SPIN_US"),
    ("HVD_SPARK_EXPRESS_LANE_BYTES", "-1", "HVD_SPARK_EXPRESS_LANE_BYTES"),
    ("HVD_SPARK_ARENA_BYTES", "100", "HVD_SPARK_ARENA_BYTES must be at least 4096"),
    ("HVD_SPARK_ARENA_BYTES", "-1", "HVD_SPARK_ARENA_BYTES"),
    ("HVD_SPARK_SPIN_US", "often", "HVD_SPARK_SPIN_US"),
    ("HOROVOD_GLOO_TIMEOUT_SECONDS", "0", "HOROVOD_GLOO_TIMEOUT_SECONDS"),
    ("HOROVOD_FUSION_THRESHOLD", "-5", "HOROVOD_FUSION_THRESHOLD"),
    ("HOROVOD_FUSION_THRESHOLD", "64MB", "HOROVOD_FUSION_THRESHOLD"),
    ("HOROVOD_CYCLE_TIME", "-1", "HOROVOD_CYCLE_TIME"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "0", "HOROVOD_STALL_CHECK_TIME_SECONDS"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "-3", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "10", "shorter than the stall warning"),
])
def test_bad_engine_values_named(monkeypatch, var, value, needle):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=needle):
        EngineConfig.from_env()


def test_spin_is_set_or_follows_the_cpus(monkeypatch):
    """Waiting callers poll before sleeping unless this host has more ranks than CPUs."""
    from hvd_spark.config import DEFAULT_SPIN_US

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    auto = EngineConfig.from_env()
    assert auto.spin_us is None
    assert auto.spin_seconds(2) == DEFAULT_SPIN_US / 1e6
    assert auto.spin_seconds(3) == 0.0  # oversubscribed: a spinner steals its peer's CPU
    monkeypatch.setenv("HVD_SPARK_SPIN_US", "250")
    assert EngineConfig.from_env().spin_seconds(8) == pytest.approx(250e-6)
    monkeypatch.setenv("HVD_SPARK_SPIN_US", "0")
    assert EngineConfig.from_env().spin_seconds(1) == 0.0


def test_world_info_partial_launcher_env_names_the_missing_one(monkeypatch):
    monkeypatch.setenv("HVD_SPARK_RANK", "0")
    monkeypatch.setenv("HVD_SPARK_SIZE", "2")
    with pytest.raises(ConfigError, match="HVD_SPARK_SECRET.*hvdrun"):
        WorldInfo.from_env()


def test_world_info_from_launcher_env(monkeypatch):
    for var, value in {"HVD_SPARK_RANK": "1", "HVD_SPARK_SIZE": "3", "HVD_SPARK_LOCAL_RANK": "0",
                       "HVD_SPARK_LOCAL_SIZE": "1", "HVD_SPARK_CROSS_RANK": "1",
                       "HVD_SPARK_CROSS_SIZE": "3", "HVD_SPARK_RENDEZVOUS_ADDR": "h:1",
                       "HVD_SPARK_SECRET": "ab" * 16, "HVD_SPARK_HOSTNAME": "node7"}.items():
        monkeypatch.setenv(var, value)
    world = WorldInfo.from_env()
    assert (world.rank, world.size, world.local_rank, world.local_size, world.cross_rank,
            world.cross_size) == (1, 3, 0, 1, 1, 3)
    assert (world.rendezvous_addr, world.hostname, world.standalone) == ("h:1", "node7", False)
    assert world.secret == bytes.fromhex("ab" * 16)


def test_world_info_standalone_without_launcher():
    first, second = WorldInfo.from_env(), WorldInfo.from_env()
    assert first.standalone is True
    assert (first.rank, first.size, first.local_rank, first.local_size, first.cross_rank,
            first.cross_size) == (0, 1, 0, 1, 0, 1)
    assert first.rendezvous_addr == "" and first.advertise_addr == ""
    assert len(first.secret) >= 16 and first.secret != second.secret  # random each time
    assert first.hostname == socket.gethostname()


@pytest.mark.parametrize("var", _FOREIGN)
def test_world_info_refuses_other_launchers_many_ranks(monkeypatch, var):
    monkeypatch.setenv(var, "4")
    with pytest.raises(ConfigError, match=f"{var}=4.*hvdrun -np 4"):
        WorldInfo.from_env()


def test_world_info_other_launcher_with_one_rank_is_standalone(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("HOROVOD_SIZE", "1")
    assert WorldInfo.from_env().standalone


def test_standalone_world_must_have_one_rank():
    with pytest.raises(ConfigError, match="standalone"):
        WorldInfo(rank=0, size=2, local_rank=0, local_size=2, cross_rank=0, cross_size=1,
                  rendezvous_addr="", secret=b"k" * 32, hostname="h", standalone=True)


def test_world_info_rank_out_of_range():
    with pytest.raises(ConfigError, match="outside"):
        WorldInfo(rank=3, size=2, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                  rendezvous_addr="x:1", secret=b"k" * 32, hostname="h")


def _launched(monkeypatch):
    for var, value in {"HVD_SPARK_RANK": "0", "HVD_SPARK_SIZE": "1",
                       "HVD_SPARK_RENDEZVOUS_ADDR": "h:1", "HVD_SPARK_SECRET": "cd" * 16}.items():
        monkeypatch.setenv(var, value)


def test_gloo_iface_gives_the_advertised_address(monkeypatch):
    _launched(monkeypatch)
    assert interface_address("lo") == "127.0.0.1"
    monkeypatch.setenv("HOROVOD_GLOO_IFACE", "lo")
    assert WorldInfo.from_env().advertise_addr == "127.0.0.1"
    monkeypatch.setenv("HVD_SPARK_ADVERTISE_ADDR", "10.1.2.3")  # an explicit address wins
    assert WorldInfo.from_env().advertise_addr == "10.1.2.3"


def test_unknown_iface_is_named_with_the_interfaces_there(monkeypatch):
    _launched(monkeypatch)
    monkeypatch.setenv("HOROVOD_GLOO_IFACE", "nosuch0")
    with pytest.raises(ConfigError, match=r"HOROVOD_GLOO_IFACE='nosuch0'.*'lo'"):
        WorldInfo.from_env()


def test_eager_limit_of_lone_allreduces_shrinks_with_the_job_unless_set(monkeypatch):
    """Rank 0's eager negotiation carries size - 1 tensors each way: a synchronous (lone)
    allreduce's default limit is a budget over them, never below 64 KB; the others keep
    64 KB. A setting is taken as it is for both, 0 included."""
    cfg = EngineConfig.from_env()
    assert cfg.eager_bytes is None
    sizes = (1, 2, 3, 5, 9, 64)
    assert {s: cfg.eager_limit(s, lone=True) for s in sizes} == {
        1: 256 << 10, 2: 256 << 10, 3: 128 << 10, 5: 64 << 10, 9: 64 << 10, 64: 64 << 10}
    assert {cfg.eager_limit(s) for s in sizes} == {64 << 10}
    for value in ("0", "1000"):
        monkeypatch.setenv("HVD_SPARK_EAGER_BYTES", value)
        cfg = EngineConfig.from_env()
        assert {cfg.eager_limit(s, lone) for s in (2, 9) for lone in (False, True)} == {
            int(value)}
    monkeypatch.setenv("HVD_SPARK_EAGER_BYTES", "-1")
    with pytest.raises(ConfigError, match="HVD_SPARK_EAGER_BYTES must be >= 0"):
        EngineConfig.from_env()


def test_the_host_arena_is_on_by_default_and_zero_turns_it_off(monkeypatch):
    monkeypatch.delenv("HVD_SPARK_ARENA_BYTES", raising=False)
    assert EngineConfig.from_env().arena_bytes == 1 << 20
    monkeypatch.setenv("HVD_SPARK_ARENA_BYTES", "0")
    assert EngineConfig.from_env().arena_bytes == 0
