"""Form an hvd_spark job from ``MPI.COMM_WORLD``: ranks, hosts and the engine.

``mpirun`` (``hvdrun --mpi``) started the ranks, so there is no rendezvous store and no
mesh: the local ranks are the ranks sharing memory with us, the cross ranks are the
ranks with our local rank on the other hosts, as in Horovod.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from typing import Any

from mpi4py import MPI

from hvd_spark import _env
from hvd_spark.collectives.mpi.communicator import MpiCommunicator
from hvd_spark.collectives.mpi.engine import MpiEngine
from hvd_spark.collectives.mpi.negotiation import Negotiation
from hvd_spark.collectives.mpi.waiting import AbortChannel, wait
from hvd_spark.collectives.nccl import device
from hvd_spark.config import DEFAULT_START_TIMEOUT_S, EngineConfig, WorldInfo
from hvd_spark.errors import BackendUnavailableError, CollectiveTimeoutError

log = logging.getLogger(__name__)


def start(config: EngineConfig, comm: Any = None
          ) -> tuple[WorldInfo, MpiEngine, dict[int, str]]:
    """Join the MPI job: returns this rank's world, its running engine, and rank -> host.

    Args:
        config: The engine's settings.
        comm: The mpi4py communicator whose ranks form the job (Horovod's
            ``init(comm=...)``; duplicated, never used directly); None: ``MPI.COMM_WORLD``.

    Raises:
        BackendUnavailableError: The MPI library cannot serve a background thread.
        CollectiveTimeoutError: Some rank did not call ``init()`` within the start timeout
            or the collective timeout, whichever is longer.
    """
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise BackendUnavailableError(
            "the MPI library was initialized without thread support (MPI_THREAD_SERIALIZED or "
            "more is needed: the collectives run in a background thread); do not set "
            "mpi4py.rc.thread_level below 'serialized'")
    world = MPI.COMM_WORLD if comm is None else comm
    rank, size = world.Get_rank(), world.Get_size()
    # MPI's communicator calls below block without a deadline: first make sure every rank
    # is here, with one. mpirun started and connected every rank (MPI_Init) before this;
    # what a peer still does is import its framework, which the start timeout does not
    # count (as in Horovod, and as the TCP backend's init() waits): wait for it as long
    # as a collective waits for its peers.
    start_timeout = _env.get_float(_env.START_TIMEOUT, DEFAULT_START_TIMEOUT_S)
    waited = max(start_timeout, config.timeout)
    try:
        wait(world.Ibarrier(), time.monotonic() + waited, None,
             f"hvd_spark.init() on rank {rank}: waiting for all {size} MPI ranks to call "
             "init()")
    except CollectiveTimeoutError as exc:
        _abort_job(world, exc)
        raise
    data, control, aborts = world.Dup(), world.Dup(), world.Dup()
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    cross = world.Split(color=local.Get_rank(), key=rank)
    hostname = _env.get_str(_env.HOSTNAME) or socket.gethostname()
    hosts = dict(enumerate(world.allgather(hostname)))
    secret = world.bcast(secrets.token_bytes(32) if rank == 0 else None, root=0)
    info = WorldInfo(
        rank=rank, size=size, local_rank=local.Get_rank(), local_size=local.Get_size(),
        cross_rank=cross.Get_rank(), cross_size=cross.Get_size(), rendezvous_addr="",
        secret=secret, hostname=hostname)
    local.Free()
    cross.Free()
    channel = AbortChannel(aborts)
    comm = MpiCommunicator(data, config.timeout, channel)
    engine = MpiEngine(comm, Negotiation(control, channel, config.timeout), config,
                       routed=device.wrap(comm, hostname))
    return info, engine, hosts


def _abort_job(world: Any, exc: CollectiveTimeoutError) -> None:
    """End every rank of the job after the start barrier timed out here.

    The barrier cannot be withdrawn: a late rank would still complete it and then block
    in the collective calls after it, while this rank's ``MPI_Finalize`` at exit waits for
    that rank, and neither would ever end. ``MPI_Abort`` ends the whole job instead; the
    reason is logged first, as the exception will not get further.
    """
    log.error("%s; aborting the MPI job (if a rank takes longer to start, raise "
              "HVD_SPARK_TIMEOUT, or hvdrun's --timeout)", exc)
    for handler in [*logging.getLogger().handlers, logging.lastResort]:
        if handler is not None:
            handler.flush()
    world.Abort(1)
