"""Backend name -> factory, imported lazily so unused backends cost nothing."""

from __future__ import annotations

import importlib
import socket
from collections.abc import Callable

from hvd_spark.collectives.communicator import Communicator
from hvd_spark.config import EngineConfig, WorldInfo
from hvd_spark.errors import BackendUnavailableError, ConfigError

# factory(world, config, data_socks) -> Communicator
Factory = Callable[[WorldInfo, EngineConfig, dict[int, socket.socket]], Communicator]

_BACKENDS: dict[str, str] = {
    "tcp": "hvd_spark.collectives.tcp.communicator:create",
}


def register(name: str, target: str) -> None:
    """Register ``module:function`` as the factory of backend ``name``."""
    _BACKENDS[name] = target


def names() -> list[str]:
    """Registered backend names."""
    return sorted(_BACKENDS)


def resolve(name: str) -> Factory:
    """Return the factory for ``name`` ("auto" picks tcp on CPU)."""
    if name == "auto":
        name = "tcp"
    target = _BACKENDS.get(name)
    if target is None:
        raise ConfigError(
            f"unknown collectives backend {name!r}; HVD_SPARK_BACKEND must be one of "
            f"{['auto', *names()]}"
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(f"backend {name!r} cannot be imported: {exc}") from exc
    return getattr(module, attr)
