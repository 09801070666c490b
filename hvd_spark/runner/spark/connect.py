"""Spark Connect sessions seen through the few SparkContext members the launcher reads.

A Connect client (``SparkSession.builder.remote("sc://...")``) has no SparkContext: the
driver JVM is on the server's side. ``ConnectContext`` answers ``master``,
``defaultParallelism`` and ``getConf().get`` from the session's runtime configuration
(and, where the master does not say, one tiny query), so the launcher's checks stay the
same for both kinds of session. The run's driver service lives in this client process,
so the executors must be able to dial it: it listens on the address this machine uses to
reach the Connect server.
"""

from __future__ import annotations

import contextlib
import re
import socket
from typing import Any

# Rows of the probe query: enough for every partition of any real cluster to hold one.
_PROBE_ROWS = 1 << 16


def is_connect(session: Any) -> bool:
    """True for a Spark Connect session (pyspark.sql.connect), False for a classic one."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def route_address(host: str, port: int) -> str:
    """The local IPv4 address this machine would use to reach ``host`` (no packet is sent).

    Raises:
        OSError: ``host`` does not resolve to an IPv4 address.
    """
    addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(addr)  # UDP: only picks the route
        return probe.getsockname()[0]


class ConnectContext:
    """The launcher's view of a Spark Connect session (SparkContext's names, read-only).

    Args:
        session: A ``pyspark.sql.connect.session.SparkSession``.
    """

    def __init__(self, session: Any) -> None:
        self.session = session
        self.master: str = self.get("spark.master", "") or ""
        builder = getattr(session.client, "_builder", None)
        self.server_host: str = getattr(builder, "host", None) or "localhost"
        self.server_port: int = int(getattr(builder, "_port", None) or 15002)
        self._parallelism: int | None = None

    def getConf(self) -> ConnectContext:  # noqa: N802 - SparkContext's name
        """This object: ``get(key, default)`` reads the session's configuration."""
        return self

    def get(self, key: str, default: str | None = None) -> str | None:
        """A Spark configuration value, or ``default`` when it is not set."""
        value = None
        with contextlib.suppress(Exception):  # an unknown key may raise on the server side
            value = self.session.conf.get(key, None)
        return default if value is None else str(value)

    @property
    def defaultParallelism(self) -> int:  # noqa: N802 - SparkContext's name
        """Task slots of the cluster: from the master where it says, else measured once."""
        if self._parallelism is None:
            self._parallelism = self._parallelism_from_master() or self._measure_parallelism()
        return self._parallelism

    def _parallelism_from_master(self) -> int | None:
        configured = self.get("spark.default.parallelism")
        if configured:
            return int(configured)
        match = re.fullmatch(r"local\[(\d+)(?:,\s*\d+)?\]", self.master)
        if match:
            return int(match.group(1))
        if self.master == "local":
            return 1
        match = re.fullmatch(r"local-cluster\[(\d+),\s*(\d+),\s*\d+\]", self.master)
        if match:
            return int(match.group(1)) * int(match.group(2))
        return None

    def _measure_parallelism(self) -> int:
        # range() without numPartitions gets the server's default parallelism (the cores
        # of local[*] or of the registered executors): count its partitions.
        from pyspark.sql import functions as F

        row = self.session.range(0, _PROBE_ROWS).select(
            F.spark_partition_id().alias("p")).agg(F.max("p").alias("last")).first()
        return int(row["last"]) + 1

    def driver_hosts(self) -> tuple[str, str]:
        """(interface to bind, address tasks dial) for the driver service in this client."""
        address = route_address(self.server_host, self.server_port)
        return address, address
