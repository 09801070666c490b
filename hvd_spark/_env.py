"""Every HVD_SPARK_* environment variable, named once and read at the edges.

Launchers write these for each rank; the collectives read them in ``init()``.
Users may tune the engine through the ``ENGINE_*`` ones.
"""

from __future__ import annotations

import os

from hvd_spark.errors import ConfigError

# Set by the launchers (hvdrun / hvd_spark.run) for every rank.
RANK = "HVD_SPARK_RANK"
SIZE = "HVD_SPARK_SIZE"
LOCAL_RANK = "HVD_SPARK_LOCAL_RANK"
LOCAL_SIZE = "HVD_SPARK_LOCAL_SIZE"
CROSS_RANK = "HVD_SPARK_CROSS_RANK"
CROSS_SIZE = "HVD_SPARK_CROSS_SIZE"
RENDEZVOUS_ADDR = "HVD_SPARK_RENDEZVOUS_ADDR"
SECRET = "HVD_SPARK_SECRET"
RUN_ID = "HVD_SPARK_RUN_ID"
HOSTNAME = "HVD_SPARK_HOSTNAME"
ADVERTISE_ADDR = "HVD_SPARK_ADVERTISE_ADDR"

# Tuning knobs a user may set.
BACKEND = "HVD_SPARK_BACKEND"
TIMEOUT = "HVD_SPARK_TIMEOUT"
START_TIMEOUT = "HVD_SPARK_START_TIMEOUT"
FUSION_THRESHOLD = "HVD_SPARK_FUSION_THRESHOLD"
CYCLE_TIME = "HVD_SPARK_CYCLE_TIME"
CHUNK_BYTES = "HVD_SPARK_CHUNK_BYTES"
DISABLE_SHM = "HVD_SPARK_DISABLE_SHM"
STALL_WARNING = "HVD_SPARK_STALL_WARNING_TIME"


def get_str(name: str, default: str | None = None) -> str | None:
    """Return the variable's value, or ``default`` when unset or empty."""
    value = os.environ.get(name, "")
    return value if value else default


def require_str(name: str) -> str:
    """Return the variable's value or raise a ConfigError saying who should have set it."""
    value = os.environ.get(name)
    if not value:
        raise ConfigError(
            f"{name} is not set: hvd_spark.collectives.init() must run inside a process started "
            "by hvdrun, hvd_spark.run or hvd_spark.runner.run_local"
        )
    return value


def get_int(name: str, default: int) -> int:
    """Return the variable as an int, with a ConfigError naming it when it does not parse."""
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def get_float(name: str, default: float) -> float:
    """Return the variable as a float, with a ConfigError naming it when it does not parse."""
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number") from None


def get_bool(name: str, default: bool = False) -> bool:
    """Return the variable as a bool (1/true/yes/on are true)."""
    value = os.environ.get(name, "")
    if not value:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")
