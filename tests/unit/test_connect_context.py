"""ConnectContext answers the launcher's questions from a Connect session's configuration
(a stand-in session here; tests/integration/test_spark_connect.py uses a real server)."""

from __future__ import annotations

import types

import pytest

from hvd_spark.runner.spark.connect import ConnectContext, is_connect, route_address


class _Conf:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, key: str, default=None):
        if key == "spark.bad":
            raise RuntimeError("the server refuses this key")
        return self.values.get(key, default)


def _session(master: str, **conf: str):
    builder = types.SimpleNamespace(host="10.0.0.5", _port=15002)
    values = {"spark.master": master, **{k.replace("_", "."): v for k, v in conf.items()}}
    return types.SimpleNamespace(conf=_Conf(values), client=types.SimpleNamespace(_builder=builder))


@pytest.mark.parametrize("master, slots", [("local[4]", 4), ("local", 1), ("local[3, 2]", 3),
                                           ("local-cluster[2, 3, 1024]", 6)])
def test_parallelism_comes_from_the_master(master, slots):
    assert ConnectContext(_session(master)).defaultParallelism == slots


def test_configured_parallelism_wins_and_unknown_keys_fall_back():
    context = ConnectContext(_session("yarn", spark_default_parallelism="12"))
    assert context.defaultParallelism == 12
    assert context.getConf().get("spark.task.cpus", "1") == "1"
    assert context.get("spark.bad", "fallback") == "fallback"
    assert (context.server_host, context.server_port) == ("10.0.0.5", 15002)


def test_a_cluster_master_is_measured_once_with_a_query(monkeypatch):
    context = ConnectContext(_session("spark://m:7077"))
    calls = []
    monkeypatch.setattr(context, "_measure_parallelism", lambda: calls.append(1) or 8)
    assert context.defaultParallelism == 8 and context.defaultParallelism == 8
    assert calls == [1]


def test_only_connect_sessions_are_connect():
    connect_cls = type("SparkSession", (), {"__module__": "pyspark.sql.connect.session"})
    classic_cls = type("SparkSession", (), {"__module__": "pyspark.sql.session"})
    assert is_connect(connect_cls()) and not is_connect(classic_cls())


def test_the_service_listens_on_the_route_to_the_server():
    assert route_address("127.0.0.1", 15002) == "127.0.0.1"
