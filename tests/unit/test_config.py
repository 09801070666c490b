"""Configuration objects fail early and name the variable."""

from __future__ import annotations

import pytest

from hvd_spark.config import EngineConfig, WorldInfo
from hvd_spark.errors import ConfigError


def test_engine_config_from_env(monkeypatch):
    monkeypatch.setenv("HVD_SPARK_FUSION_THRESHOLD", "1024")
    monkeypatch.setenv("HVD_SPARK_CYCLE_TIME", "2.5")
    monkeypatch.setenv("HVD_SPARK_DISABLE_SHM", "1")
    cfg = EngineConfig.from_env()
    assert (cfg.fusion_threshold, cfg.cycle_time_ms, cfg.use_shm) == (1024, 2.5, False)


@pytest.mark.parametrize("var,value,needle", [
    ("HVD_SPARK_TIMEOUT", "-1", "HVD_SPARK_TIMEOUT"),
    ("HVD_SPARK_TIMEOUT", "soon", "HVD_SPARK_TIMEOUT"),
    ("HVD_SPARK_CHUNK_BYTES", "12", "HVD_SPARK_CHUNK_BYTES"),
])
def test_bad_engine_values_named(monkeypatch, var, value, needle):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=needle):
        EngineConfig.from_env()


def test_world_info_requires_launcher(monkeypatch):
    for var in ("HVD_SPARK_RANK", "HVD_SPARK_SIZE", "HVD_SPARK_SECRET"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="hvdrun"):
        WorldInfo.from_env()


def test_world_info_rank_out_of_range():
    with pytest.raises(ConfigError, match="outside"):
        WorldInfo(rank=3, size=2, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                  rendezvous_addr="x:1", secret=b"k" * 32, hostname="h")
