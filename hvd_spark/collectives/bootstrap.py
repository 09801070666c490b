"""Joining and leaving the job: ``init()`` forms the ring and starts the engine,
``shutdown()`` stops it; the heartbeat and the timeline run alongside.

Configuration comes from the environment the launchers set; users only call
``init()``. Every blocking call has a deadline (HVD_SPARK_TIMEOUT).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

from hvd_spark import _env
from hvd_spark.collectives import membership, registry, timeline
from hvd_spark.collectives.buffers import OUTPUTS
from hvd_spark.collectives.heartbeat import DEFAULT_HEARTBEAT_S, Heartbeat
from hvd_spark.collectives.process_set_registry import (
    add_process_set,
    clear_registry,
    start_registry,
)
from hvd_spark.collectives.process_sets import ProcessSet
from hvd_spark.collectives.session import STATE, require
from hvd_spark.collectives.tcp import wire
from hvd_spark.collectives.tcp.engine import TcpEngine as Engine
from hvd_spark.collectives.tcp.mesh import build_mesh
from hvd_spark.collectives.tcp.store import StoreClient
from hvd_spark.config import DEFAULT_START_TIMEOUT_S, EngineConfig, WorldInfo
from hvd_spark.errors import (
    AuthenticationError,
    ConfigError,
    HorovodInternalError,
    HvdSparkError,
    PeerDisconnectedError,
    RendezvousTimeoutError,
)

log = logging.getLogger(__name__)

#: How a ring's forming fails when a member is missing: the next generation may do better.
_RING_FAILURES = (RendezvousTimeoutError, HorovodInternalError, AuthenticationError)


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None) -> None:
    """Join the job: connect to every other rank. Safe to call more than once.

    Run without a launcher (a plain ``python train.py``), this is a one-rank job.

    Args:
        comm: Horovod's MPI communicator argument: an mpi4py communicator in ranks that
            mpirun started (the job is that communicator's ranks), or None (or every rank,
            as a list of ranks equal to the whole job).
        process_sets: Process sets to add at start (Horovod's static process sets).
    """
    mpi_comm = comm if registry.is_mpi_communicator(comm) else None
    if comm is not None and mpi_comm is None and not isinstance(comm, (list, tuple)):
        raise ConfigError(
            f"init(comm=...) takes an mpi4py communicator or a list of ranks, got "
            f"{type(comm).__name__}; start the ranks with hvdrun or hvd_spark.run and call init()")
    with STATE.lock:
        if STATE.engine is not None:
            return
        config = EngineConfig.from_env()
        OUTPUTS.max_idle_bytes = config.output_pool_bytes
        _env.apply_log_level()
        _env.warn_unsupported_horovod_vars()  # one log line naming what cannot be honoured
        backend = _env.get_str(_env.BACKEND, "auto") or "auto"
        factory = registry.resolve(backend)
        own_world = registry.own_world(backend, mpi_comm)
        if own_world is not None:
            # mpirun started the ranks (hvdrun --mpi): MPI itself forms the job and runs it.
            world, STATE.engine, hosts = own_world(config, mpi_comm)
        elif membership.is_elastic():
            world, hosts = _join_next_ring(config, factory)
        else:
            world = WorldInfo.from_env()
            epoch = next(STATE.epochs)
            if world.rendezvous_addr and _env.get_str(_env.HEARTBEAT):
                start_heartbeat(wire.parse_addr(world.rendezvous_addr, _env.RENDEZVOUS_ADDR),
                                 world.secret, str(world.rank))
            STATE.engine, hosts = _start_engine(world, _spin_for(config, world), factory,
                                                epoch)
        STATE.world = world
        per_host = collections.Counter(hosts.values())
        STATE.homogeneous = len(set(per_host.values())) <= 1
        STATE.names.clear()
        start_registry(world)
    atexit.register(shutdown)
    if config.timeline_path and world.rank == 0:
        timeline.start_timeline(config.timeline_path, config.timeline_mark_cycles)
    for ps in process_sets or ():
        add_process_set(ps)


def _spin_for(config: EngineConfig, world: WorldInfo) -> EngineConfig:
    """Polling or not depends on how many ranks share this host's CPUs: settled once."""
    return dataclasses.replace(config, spin_us=config.spin_seconds(world.local_size) * 1e6)


def _join_next_ring(config: EngineConfig, factory: registry.Factory
                    ) -> tuple[WorldInfo, dict[int, str]]:
    """Join the launcher's next generation and connect its ring; the session's engine is
    set. A ring that does not form, or that the launcher gave up while it formed (a
    member froze or died), is left for the next generation; the launcher's deadlines end
    the job (``join`` raises) when none can form.
    """
    member = membership.membership()
    start_heartbeat(member.addr, member.secret, member.worker)
    while True:
        # A first ring that fails without the launcher giving it up (a wrong interface,
        # a blocked port) fails init() as in a fixed-size job: every generation would.
        first = member.generation == 0
        world = member.join()  # blocks until the launcher forms the next generation
        # torch.distributed code re-creates its process group after each reset from
        # the generation's torchrun variables (rank, size, master).
        os.environ.update(member.torch_env)
        epoch = member.generation
        with STATE.abort_lock:
            STATE.generation = epoch
        if STATE.heartbeat is not None:
            STATE.heartbeat.set_generation(epoch)
        try:
            engine, hosts = _start_engine(world, _spin_for(config, world), factory, epoch)
        except _RING_FAILURES as exc:
            if first and _broken_reason(epoch) is None:
                raise
            log.warning("the ring of generation %d did not form (%s); joining the next one",
                        epoch, exc)
            continue
        with STATE.abort_lock:
            broken = _broken_reason(epoch)
            if broken is None:
                STATE.engine = engine
                return world, hosts
        log.warning("the ring of generation %d was given up as it formed (%s); joining "
                    "the next one", epoch, broken)
        engine.abort(PeerDisconnectedError(broken))
        engine.shutdown()


def _broken_reason(generation: int) -> str | None:
    """Why the launcher gave up ring ``generation``, if it did."""
    broken = STATE.broken
    return broken[1] if broken is not None and broken[0] == generation else None


def _start_engine(world: WorldInfo, config: EngineConfig, factory: registry.Factory,
                  epoch: int) -> tuple[Engine, dict[int, str]]:
    """Connect to the other ranks (unless this is a one-rank job) and start the engine.

    Returns:
        The engine and every rank's hostname.
    """
    if not world.rendezvous_addr:
        # No launcher: a one-rank job, as Horovod gives a plain `python train.py`.
        engine = Engine(world.rank, world.size, factory(world, config, {}), {}, config)
        return engine, {0: world.hostname}
    start_timeout = connect_timeout = _env.get_float(_env.START_TIMEOUT,
                                                     DEFAULT_START_TIMEOUT_S)
    if membership.is_elastic():
        # Members of a new generation are all alive and waiting: a ring that does
        # not form quickly lost a member, and the next generation will do better.
        start_timeout = connect_timeout = min(start_timeout, membership.MESH_TIMEOUT_S)
    else:
        # Peers may still be importing their framework, which the start timeout does not
        # count (as in Horovod): wait for their addresses as long as a collective waits
        # for its peers. Once all are known, every peer listens: dialling them keeps the
        # start timeout, so an unreachable address (a wrong interface) fails in time.
        start_timeout = max(start_timeout, config.timeout)
    addr = wire.parse_addr(world.rendezvous_addr, _env.RENDEZVOUS_ADDR)
    store = StoreClient(addr, world.secret, start_timeout)
    with STATE.abort_lock:
        STATE.forming = store  # the heartbeat's abort interrupts its waits
    try:
        mesh = build_mesh(
            world.rank, world.size, store, world.secret, world.hostname,
            world.advertise_addr, start_timeout, epoch, local_sockets=config.use_shm,
            connect_timeout=connect_timeout,
        )
    except (HvdSparkError, OSError) as exc:
        reason = _broken_reason(STATE.generation)
        if reason is None:
            raise
        # Cut short by the launcher's word (``_abort``): that is the cause to name.
        raise PeerDisconnectedError(reason) from exc
    finally:
        with STATE.abort_lock:
            STATE.forming = None
        store.close()
    for sock in [*mesh.data.values(), *mesh.control.values()]:
        sock.settimeout(config.timeout)
    comm = factory(world, config, mesh.data)
    return Engine(world.rank, world.size, comm, mesh.control, config), mesh.hosts


def start_heartbeat(addr: tuple[str, int], secret: bytes, worker: str) -> None:
    """Beat to the launcher from now on (once per process), if the launcher asked for it.

    ``init()`` calls it; so does the rank's worker before the job's function runs, so
    that a rank frozen outside our collectives (in torch.distributed's) is found too.
    """
    interval = _env.get_float(_env.HEARTBEAT, DEFAULT_HEARTBEAT_S)
    if STATE.heartbeat is not None:
        STATE.heartbeat.set_generation(STATE.generation)
        return
    if interval <= 0:
        return
    # Not stopped at exit: a rank that finished but exits slowly (a loaded host, a large
    # framework's teardown) keeps beating until its process ends, so the launcher sees it
    # exit, not fall silent (an elastic job would wait out its timeout for a lost member).
    STATE.heartbeat = Heartbeat(addr, secret, worker, interval, _abort)


def _abort(generation: int, reason: str) -> None:
    """The launcher says ring ``generation`` is broken: fail its collectives now.

    The word may come while ``init()`` still forms that ring (a member froze or died as
    it formed): it is kept, the ring's rendezvous waits are cut short, and ``init()``
    joins the next generation instead of training on in a ring the launcher gave up.
    """
    with STATE.abort_lock:
        if generation != STATE.generation:
            return
        STATE.broken = (generation, reason)
        engine, forming = STATE.engine, STATE.forming
    if engine is not None:
        engine.abort(PeerDisconnectedError(reason))
    elif forming is not None:
        forming.interrupt()


def shutdown() -> None:
    """Leave the job (waits briefly for the other ranks to leave too)."""
    with STATE.lock:
        engine, STATE.engine, STATE.world = STATE.engine, None, None
        clear_registry()
    with STATE.abort_lock:
        STATE.broken = None  # the word was for the ring just left
    if engine is not None:
        engine.shutdown()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a Chrome-trace timeline of the collectives to ``file_path`` (rank 0 writes it).

    Every rank may call it, as in Horovod; starting again switches to the new file.
    """
    world, _ = require()
    if world.rank == 0:
        timeline.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop recording the timeline and close its file."""
    require()
    timeline.stop_timeline()
