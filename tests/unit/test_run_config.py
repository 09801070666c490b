"""The runner's configuration objects: checked once, frozen, errors naming the parameter."""

from __future__ import annotations

import dataclasses

import pytest

from hvd_spark.errors import ConfigError
from hvd_spark.runner.run_config import ElasticConfig, RunConfig, Timeouts


@pytest.mark.parametrize("kwargs, match", [
    (dict(env={"A": 1}), "env must map str to str; not so for"),
    (dict(num_proc=0), "num_proc must be a positive integer, got 0"),
    (dict(num_proc="2"), "num_proc must be a positive integer"),
    (dict(start_timeout=0), "start_timeout must be positive seconds, got 0"),
    (dict(start_timeout="soon"), "start_timeout must be positive seconds"),
    (dict(env={"HVD_SPARK_HEARTBEAT_S": "often"}), "HVD_SPARK_HEARTBEAT_S='often' in env"),
])
def test_bad_run_arguments_are_refused_naming_the_parameter(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_kwargs(**kwargs)


def test_defaults_come_from_the_arguments_then_the_environment(monkeypatch):
    monkeypatch.setenv("HVD_SPARK_START_TIMEOUT", "42")
    monkeypatch.setenv("HVD_SPARK_HEARTBEAT_S", "7")
    config = RunConfig.from_kwargs(env={"HVD_SPARK_HEARTBEAT_S": "3"})
    assert config.timeouts.start_timeout_s == 42.0
    assert config.timeouts.heartbeat_s == 3.0  # the run's env wins over the driver's
    assert RunConfig.from_kwargs(start_timeout=5).timeouts.start_timeout_s == 5.0


def test_a_config_is_frozen_all_the_way_down():
    config = RunConfig.from_kwargs(env={"A": "1"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_proc = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.env["A"] = "2"  # type: ignore[index]
    assert config.with_num_proc(4).num_proc == 4 and config.num_proc is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(heartbeat_s=-1), "heartbeat_s must be >= 0"),
    (dict(elastic_timeout_s=0), "elastic_timeout must be positive seconds"),
    (dict(collective_timeout_s=-3), "timeout must be positive seconds"),
    (dict(stop_grace_s=-1), "stop_grace_s must be >= 0 seconds"),
])
def test_bad_deadlines_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Timeouts(**kwargs)


def test_elastic_config_reads_its_deadlines_from_its_timeouts():
    config = ElasticConfig.of(num_proc=2, min_np=1, max_np=3, start_timeout=9,
                              elastic_timeout=8, heartbeat_s=0)
    assert (config.start_timeout_s, config.elastic_timeout_s, config.heartbeat_s) == (9, 8, 0)
    assert config.timeouts == Timeouts(start_timeout_s=9, elastic_timeout_s=8, heartbeat_s=0)
    with pytest.raises(ConfigError, match="min_np <= num_proc <= max_np"):
        ElasticConfig.of(num_proc=4, min_np=1, max_np=3)


def test_elastic_deadlines_given_as_zero_are_errors_not_the_default(monkeypatch) -> None:
    from hvd_spark.errors import ConfigError
    from hvd_spark.runner.elastic.elastic_local import run_elastic_local
    from hvd_spark.runner.run_config import ElasticConfig

    for name in ("start_timeout", "elastic_timeout"):
        with pytest.raises(ConfigError, match=f"{name} must be positive seconds, got 0"):
            ElasticConfig.from_kwargs(2, **{name: 0})
    with pytest.raises(ConfigError, match="start_timeout must be positive"):
        run_elastic_local(lambda: 0, num_proc=2, start_timeout=0)  # before anything starts
    monkeypatch.setenv("HVD_SPARK_ELASTIC_TIMEOUT", "42")
    settings = ElasticConfig.from_kwargs(3, min_np=2)
    assert (settings.min_np, settings.max_np, settings.elastic_timeout_s) == (2, 3, 42.0)
    assert ElasticConfig.from_kwargs(3, elastic_timeout=7).elastic_timeout_s == 7.0


def test_run_config_takes_exactly_runs_keywords():
    """One definition of the options: RunConfig.from_kwargs takes what hvd_spark.run takes
    (besides the function, its arguments and the DataFrame), no more, no less."""
    import inspect

    from hvd_spark.runner.api import run

    run_options = set(inspect.signature(run).parameters) - {"fn", "args", "kwargs", "df"}
    assert set(RunConfig.keywords()) - {"ranks_per_task"} == run_options
    with pytest.raises(ConfigError, match=r"SparkBackend got unknown keyword\(s\) \['bogus'\]"):
        RunConfig.from_kwargs(where="SparkBackend", bogus=1)


def test_horovods_keywords_are_applied_by_the_config():
    config = RunConfig.from_kwargs(nics=["eth1", "eth0"], use_gloo=True, extra_mpi_args="-x A")
    assert config.env == {"HVD_SPARK_IFACE": "eth0"}
    with pytest.raises(ConfigError, match="use_mpi and use_gloo are both True"):
        RunConfig.from_kwargs(use_mpi=True, use_gloo=True)
