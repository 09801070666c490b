"""The TCP backend's registry factory: the flat ring, or the hierarchical all-reduce over it.

Choosing between the two lives here, above both, so neither communicator module imports
the other.
"""

from __future__ import annotations

import socket

from hvd_spark import _env
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.tcp.communicator import TcpCommunicator
from hvd_spark.collectives.tcp.hierarchical import maybe_hierarchical
from hvd_spark.collectives.tcp.shm import job_tag
from hvd_spark.config import EngineConfig, WorldInfo


def create(world: WorldInfo, config: EngineConfig,
           data_socks: dict[int, socket.socket]) -> Communicator:
    """A TcpCommunicator over the mesh's data sockets, hierarchical for all-reduce where
    the hosts allow (see ``hierarchical``)."""
    flat = TcpCommunicator(world.rank, world.size, data_socks, config.chunk_bytes, config.use_shm,
                           shm_tag=job_tag(world.secret), slot_bytes=config.slot_bytes,
                           spin_s=config.spin_seconds(world.local_size),
                           express_lane_bytes=config.express_lane_bytes,
                           arena_bytes=config.arena_bytes)
    setting = _env.get_str(_env.HIERARCHICAL_ALLREDUCE)
    return maybe_hierarchical(flat, world, None if setting is None else _env.is_true(setting),
                              config.use_shm, job_tag(world.secret))
