"""An elastic worker's membership: its link to the launcher's elastic driver.

Under an elastic launcher (``hvdrun --min-np``, ``hvd_spark.run_elastic``) a worker has no
fixed rank: each ``init()`` joins the launcher's next *generation* of the ring through its
:class:`Membership` and gets its rank there. This module is what ``init()`` needs of
elastic training; the recovery loop built on top of the collectives is in ``elastic``.
"""

from __future__ import annotations

import logging

from hvd_spark import _env
from hvd_spark.collectives.tcp import wire
from hvd_spark.collectives.tcp.store import StoreClient
from hvd_spark.config import DEFAULT_START_TIMEOUT_S, WorldInfo
from hvd_spark.errors import ConfigError

log = logging.getLogger(__name__)

JOIN = "elastic.join"
VERSION = "elastic.version"
DEFAULT_ELASTIC_TIMEOUT_S = 600.0
#: Seconds a new generation's ring may take to connect before the worker rejoins.
MESH_TIMEOUT_S = 30.0


def is_elastic() -> bool:
    """True in a worker started by an elastic launcher."""
    return _env.get_bool(_env.ELASTIC)


class Membership:
    """This worker's link to the launcher's elastic driver (one per process)."""

    def __init__(self) -> None:
        self.worker = _env.require_str(_env.WORKER_ID)
        self.addr = wire.parse_addr(_env.require_str(_env.RENDEZVOUS_ADDR), _env.RENDEZVOUS_ADDR)
        try:
            self.secret = bytes.fromhex(_env.require_str(_env.SECRET))
        except ValueError:
            raise ConfigError(f"{_env.SECRET} is not hex-encoded; the launcher sets it") from None
        self.hostname = _env.get_str(_env.HOSTNAME) or ""
        self.start_timeout_s = _env.get_float(_env.START_TIMEOUT, DEFAULT_START_TIMEOUT_S)
        self.elastic_timeout_s = _env.get_float(_env.ELASTIC_TIMEOUT, DEFAULT_ELASTIC_TIMEOUT_S)
        self._client = StoreClient(self.addr, self.secret, self.start_timeout_s)
        self.generation = 0
        self.version = 0
        #: torchrun's variables for the generation this worker last joined (``join``).
        self.torch_env: dict[str, str] = {}

    def join(self) -> WorldInfo:
        """Wait for a place in the next generation; return this worker's world in it."""
        budget = self.start_timeout_s + 2 * self.elastic_timeout_s + 10.0
        # This host's address and a port free here: torch.distributed's master for the
        # generation, should this worker be its rank 0.
        endpoint = (_env.get_str(_env.ADVERTISE_ADDR) or self._client.local_address,
                    wire.free_port())
        got = self._client.call(JOIN, self.worker, self.hostname, self.generation, endpoint,
                                timeout=budget)
        self.generation, self.version = got["generation"], got["version"]
        log.info("worker %s joined generation %d as rank %d of %d", self.worker,
                 self.generation, got["rank"], got["size"])
        self.torch_env = {
            _env.TORCH_RANK: str(got["rank"]), _env.TORCH_WORLD_SIZE: str(got["size"]),
            _env.TORCH_LOCAL_RANK: str(got["local_rank"]),
            _env.TORCH_LOCAL_WORLD_SIZE: str(got["local_size"]),
            **_env.torchrun_variables(
                rank=got["rank"], size=got["size"], node_rank=got.get("node_rank", 0),
                num_nodes=got.get("num_nodes", 1), run_id=f"elastic-{self.generation}",
                master_addr=got.get("master_addr") or None,
                master_port=got.get("master_port") or None)}
        return WorldInfo(
            rank=got["rank"], size=got["size"], local_rank=got["local_rank"],
            local_size=got["local_size"], cross_rank=got["cross_rank"],
            cross_size=got["cross_size"], rendezvous_addr=f"{self.addr[0]}:{self.addr[1]}",
            secret=self.secret, hostname=self.hostname or got["host"],
            advertise_addr=_env.get_str(_env.ADVERTISE_ADDR) or "",
        )

    def hosts_updated(self) -> bool:
        """True when the driver has workers waiting to join this generation."""
        return self._client.call(VERSION, timeout=30.0) > self.version


_membership: list[Membership] = []


def membership() -> Membership:
    """This process's Membership, created at the first elastic ``init()``."""
    if not _membership:
        _membership.append(Membership())
    return _membership[0]
