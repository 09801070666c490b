"""The backend registry: a name means one backend, never silently replaced."""

from __future__ import annotations

import pytest

from hvd_spark.collectives import registry
from hvd_spark.errors import ConfigError

_TCP = "hvd_spark.collectives.tcp.factory:create"


@pytest.fixture
def backends(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The registry's table, restored after the test."""
    table = dict(registry._BACKENDS)
    monkeypatch.setattr(registry, "_BACKENDS", table)
    return table


def test_a_registered_backend_resolves_to_its_factory(backends, monkeypatch):
    monkeypatch.setenv("HVD_SPARK_GPU_BACKEND", "host")  # no device wrapper in the way
    registry.register("tcp_again", _TCP)
    assert "tcp_again" in registry.names()
    assert callable(registry.resolve("tcp_again"))
    registry.register("tcp_again", _TCP)  # the same target twice: nothing changes
    assert backends["tcp_again"] == _TCP == registry._BACKENDS["tcp"]


def test_a_second_backend_under_a_taken_name_is_refused(backends):
    with pytest.raises(ConfigError, match=r"'tcp' is registered already.*under another name"):
        registry.register("tcp", "my_backend:create")
    assert backends["tcp"] == _TCP  # the first stays


def test_auto_and_a_target_without_a_function_are_refused(backends):
    with pytest.raises(ConfigError, match="'auto' is registered already"):
        registry.register("auto", "my_backend:create")
    with pytest.raises(ConfigError, match="'module:function'"):
        registry.register("mine", "my_backend")
    assert "auto" not in backends and "mine" not in backends
