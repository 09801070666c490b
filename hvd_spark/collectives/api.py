"""The framework-free collectives API on numpy arrays (Horovod's names and semantics).

Configuration comes from the environment the launchers set; users only call
``init()``. Every blocking call has a deadline (HVD_SPARK_TIMEOUT).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import itertools
import pickle
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from hvd_spark import _env
from hvd_spark.collectives import elastic, packing, registry, timeline
from hvd_spark.collectives import messages as m
from hvd_spark.collectives.buffers import OUTPUTS
from hvd_spark.collectives.engine import Engine
from hvd_spark.collectives.heartbeat import DEFAULT_HEARTBEAT_S, Heartbeat
from hvd_spark.collectives.operations import Entry, Handle
from hvd_spark.collectives.ops import (
    ReduceOp,
    array_of,
    check_dtype,
    check_reduction,
    scale_in_place,
)
from hvd_spark.collectives.process_sets import ProcessSet, global_process_set
from hvd_spark.collectives.tcp import wire
from hvd_spark.collectives.tcp.mesh import build_mesh
from hvd_spark.collectives.tcp.store import StoreClient
from hvd_spark.config import DEFAULT_START_TIMEOUT_S, EngineConfig, WorldInfo
from hvd_spark.errors import (
    CollectiveArgumentError,
    CollectiveError,
    ConfigError,
    HvdSparkError,
    PeerDisconnectedError,
)

_lock = threading.Lock()
_world: WorldInfo | None = None
_engine: Engine | None = None
_epoch = itertools.count()
# Automatic names count per process set and kind, so that they agree among each set's members.
_names: dict[tuple[int, str], itertools.count] = {}
#: Process sets added on this rank, by id (the global set is 0).
_process_sets: dict[int, ProcessSet] = {}
_homogeneous = [True]
#: The heartbeat thread (one per process, kept across re-formed rings) and the ring
#: generation it beats for (elastic jobs count generations; fixed jobs stay at 0).
_heartbeat: list[Heartbeat] = []
_generation = [0]


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None) -> None:
    """Join the job: connect to every other rank. Safe to call more than once.

    Run without a launcher (a plain ``python train.py``), this is a one-rank job.

    Args:
        comm: Horovod's MPI communicator argument: an mpi4py communicator in ranks that
            mpirun started (the job is that communicator's ranks), or None (or every rank,
            as a list of ranks equal to the whole job).
        process_sets: Process sets to add at start (Horovod's static process sets).
    """
    global _world, _engine
    mpi_comm = comm if registry.is_mpi_communicator(comm) else None
    if comm is not None and mpi_comm is None and not isinstance(comm, (list, tuple)):
        raise ConfigError(
            f"init(comm=...) takes an mpi4py communicator or a list of ranks, got "
            f"{type(comm).__name__}; start the ranks with hvdrun or hvd_spark.run and call init()")
    with _lock:
        if _engine is not None:
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
            world, _engine, hosts = own_world(config, mpi_comm)
        elif elastic.is_elastic():
            member = elastic.membership()
            _start_heartbeat(member.addr, member.secret, member.worker)
            world = member.join()  # blocks until the launcher forms the next generation
            epoch = _generation[0] = member.generation
            if _heartbeat:
                _heartbeat[0].set_generation(epoch)
        else:
            world = WorldInfo.from_env()
            epoch = next(_epoch)
            if world.rendezvous_addr and _env.get_str(_env.HEARTBEAT):
                _start_heartbeat(wire.parse_addr(world.rendezvous_addr, _env.RENDEZVOUS_ADDR),
                                 world.secret, str(world.rank))
        # Polling or not depends on how many ranks share this host's CPUs: settled once.
        config = dataclasses.replace(
            config, spin_us=config.spin_seconds(world.local_size) * 1e6)
        if own_world is not None:
            pass
        elif not world.rendezvous_addr:
            # No launcher: a one-rank job, as Horovod gives a plain `python train.py`.
            comm_, control = factory(world, config, {}), {}
        else:
            start_timeout = _env.get_float(_env.START_TIMEOUT, DEFAULT_START_TIMEOUT_S)
            if elastic.is_elastic():
                # Members of a new generation are all alive and waiting: a ring that does
                # not form quickly lost a member, and the next generation will do better.
                start_timeout = min(start_timeout, elastic.MESH_TIMEOUT_S)
            addr = wire.parse_addr(world.rendezvous_addr, _env.RENDEZVOUS_ADDR)
            store = StoreClient(addr, world.secret, start_timeout)
            try:
                mesh = build_mesh(
                    world.rank, world.size, store, world.secret, world.hostname,
                    world.advertise_addr, start_timeout, epoch, local_sockets=config.use_shm,
                )
            finally:
                store.close()
            for sock in [*mesh.data.values(), *mesh.control.values()]:
                sock.settimeout(config.timeout)
            comm_, control = factory(world, config, mesh.data), mesh.control
        if own_world is None:
            _engine = Engine(world.rank, world.size, comm_, control, config)
            hosts = mesh.hosts if world.rendezvous_addr else {0: world.hostname}
        _world = world
        per_host = collections.Counter(hosts.values())
        _homogeneous[0] = len(set(per_host.values())) <= 1
        _names.clear()
        _process_sets.clear()
        global_process_set.ranks = list(range(world.size))
        global_process_set._bind(0, world.rank)
        _process_sets[0] = global_process_set
    atexit.register(shutdown)
    if config.timeline_path and world.rank == 0:
        timeline.start_timeline(config.timeline_path, config.timeline_mark_cycles)
    for ps in process_sets or ():
        add_process_set(ps)


def _start_heartbeat(addr: tuple[str, int], secret: bytes, worker: str) -> None:
    """Beat to the launcher from now on (once per process), if the launcher asked for it."""
    interval = _env.get_float(_env.HEARTBEAT, DEFAULT_HEARTBEAT_S)
    if _heartbeat or interval <= 0:
        if _heartbeat:
            _heartbeat[0].set_generation(_generation[0])
        return
    beat = Heartbeat(addr, secret, worker, interval, _abort)
    _heartbeat.append(beat)
    atexit.register(beat.stop)


def _abort(generation: int, reason: str) -> None:
    """The launcher says ring ``generation`` is broken: fail its collectives now."""
    engine = _engine
    if engine is not None and generation == _generation[0]:
        engine.abort(PeerDisconnectedError(reason))


def shutdown() -> None:
    """Leave the job (waits briefly for the other ranks to leave too)."""
    global _world, _engine
    with _lock:
        engine, _engine, _world = _engine, None, None
        for ps in _process_sets.values():
            if ps is not global_process_set:
                ps._invalidate()
        _process_sets.clear()
    if engine is not None:
        engine.shutdown()


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return _engine is not None


def _require() -> tuple[WorldInfo, Engine]:
    world, engine = _world, _engine
    if world is None or engine is None:
        raise CollectiveError("hvd_spark is not initialized: call init() first")
    return world, engine


def rank() -> int:
    """This process's rank."""
    return _require()[0].rank


def size() -> int:
    """Number of ranks."""
    return _require()[0].size


def local_rank() -> int:
    """Rank among the processes on this host."""
    return _require()[0].local_rank


def local_size() -> int:
    """Number of ranks on this host."""
    return _require()[0].local_size


def cross_rank() -> int:
    """Index of this host."""
    return _require()[0].cross_rank


def cross_size() -> int:
    """Number of hosts."""
    return _require()[0].cross_size


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a Chrome-trace timeline of the collectives to ``file_path`` (rank 0 writes it).

    Every rank may call it, as in Horovod; starting again switches to the new file.
    """
    world, _ = _require()
    if world.rank == 0:
        timeline.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop recording the timeline and close its file."""
    _require()
    timeline.stop_timeline()


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    _require()
    return _homogeneous[0]


def backend_name() -> str:
    """Name of the backend moving the bytes (e.g. "tcp")."""
    return _require()[1].comm.name



# ---------------------------------------------------------------------- names and submission

def _members(process_set: ProcessSet, what: str) -> tuple[int, ...] | None:
    """The engine's member tuple for ``process_set``; raises on a rank outside it."""
    if process_set is global_process_set:
        return None
    world, _ = _require()
    if not isinstance(process_set, ProcessSet):
        raise ConfigError(f"{what}: process_set must be a ProcessSet, got {process_set!r}")
    if process_set.process_set_id is None or process_set.process_set_id not in _process_sets:
        raise ConfigError(
            f"{what}: {process_set} was not added (or was removed); call add_process_set first")
    if world.rank not in process_set.ranks:
        raise ConfigError(
            f"{what}: rank {world.rank} is not a member of {process_set}; only its ranks "
            f"{process_set.ranks} may call collectives on it")
    return process_set.members()


def auto_name(kind: str, name: str | None, process_set: ProcessSet = global_process_set) -> str:
    """The engine-level name of an operation: ``name`` or the next automatic one.

    Operations of a process set other than the global one are namespaced by its id, so
    the same user name may be used in several sets.
    """
    ps_id = process_set.process_set_id or 0
    name = _numbered(kind, name, ps_id)
    return name if ps_id == 0 else f"ps{ps_id}/{name}"


def group_base_name(kind: str, name: str | None,
                    process_set: ProcessSet = global_process_set) -> str:
    """The base name of a grouped ``kind`` call that a framework submits tensor by tensor
    (as ``<base>.<i>``, each call adding the process set's namespace itself).

    It takes the same automatic number as the numpy grouped call would, so unnamed groups
    of both kinds never share a name.
    """
    return _numbered(f"grouped_{kind}", name, process_set.process_set_id or 0)


def _numbered(kind: str, name: str | None, ps_id: int) -> str:
    if name is not None:
        return name
    # One counter per (set, kind): ranks that ran different numbers of one kind of
    # operation (a rank-dependent branch) still agree on the names of the others.
    counter = _names.get((ps_id, kind))
    if counter is None:
        counter = _names[(ps_id, kind)] = itertools.count()
    return f"{kind}.noname.{next(counter)}"


def report_failure(kind: str, key: str, exc: BaseException,
                   members: tuple[int, ...] | None = None) -> Handle | None:
    """Tell the other ranks that this rank's ``key`` failed its local checks.

    The coordinator then fails ``key`` on every rank with this rank's reason, instead of
    the other ranks waiting for a partner that never comes; automatic names stay aligned.

    Returns:
        The report's handle (done once every rank's request for ``key`` met it), or None
        when it could not be sent.
    """
    engine = _engine
    if engine is None:
        return None
    request = m.Request(key, kind, members=members, error=f"{type(exc).__name__}: {exc}")
    try:
        return engine.submit(Entry(request, Handle(key), np.empty(0, np.uint8)))
    except HvdSparkError:
        return None  # the name is in flight already (the error is about that), or stopped


def _fail_locally(kind: str, keys: list[str], exc: BaseException, members) -> NoReturn:
    """Report ``keys``' local failure to the other ranks, then raise it as the project's error."""
    for key in keys:
        report_failure(kind, key, exc, members)
    if isinstance(exc, HvdSparkError):
        raise exc
    raise CollectiveArgumentError(f"{kind} {keys[0]!r}: {exc}") from exc


def _start(kind: str, name: str | None, process_set: ProcessSet, build) -> Handle:
    """Name, validate and submit one operation.

    ``build(key, members)`` returns ``(request, working_array, finish or None)``, and for
    an out-of-place allreduce also the caller's input (``Entry.source``). When it raises,
    the failure is reported to the other ranks before it propagates.
    """
    _, engine = _require()
    members = _members(process_set, kind if name is None else f"{kind} {name!r}")
    key = auto_name(kind, name, process_set)
    try:
        entry = _entry(key, build(key, members))
    except (HvdSparkError, ValueError, TypeError) as exc:
        _fail_locally(kind, [key], exc, members)
    return engine.submit(entry)


def _entry(key: str, built: tuple | Entry) -> Entry:
    """An Entry from what a build function returned (see ``_start``; or the Entry)."""
    if isinstance(built, Entry):
        return built
    request, work, finish, *source = built
    entry = Entry(request, Handle(key), work, source=source[0] if source else None)
    if finish is not None:
        entry.finish = finish
    return entry


def _as_array(value: Any, what: str) -> np.ndarray:
    array = array_of(value)
    if array is None:
        raise CollectiveArgumentError(
            f"{what} expects a numpy array, got {type(value).__name__}; "
            "use the torch/tensorflow bindings for framework tensors"
        )
    check_dtype(array.dtype, what)
    return array


def synchronize(handle: Handle) -> Any:
    """Wait for an async operation and return its result (raises its error)."""
    return _require()[1].wait(handle)


def poll(handle: Handle) -> bool:
    """True when the async operation has finished."""
    if handle.done():
        return True
    # A caller polling in a tight loop would hold the GIL that the engine's threads need
    # to finish the operation (each wait for it up to the 5 ms switch interval).
    time.sleep(0)
    return handle.done()


def _in_place_finish(target: np.ndarray):
    def finish(result: np.ndarray) -> np.ndarray:
        if result is not target:
            target[...] = result.reshape(target.shape)
        return target

    return finish


def _set_rank(process_set: ProcessSet, global_rank: int, what: str) -> int:
    """A global root rank as its index in ``process_set`` (Horovod passes global ranks)."""
    if process_set is global_process_set:
        return int(global_rank)
    if int(global_rank) not in process_set.ranks:
        raise CollectiveArgumentError(
            f"{what}: root_rank {global_rank} is not a member of {process_set}")
    return process_set.ranks.index(int(global_rank))


# ---------------------------------------------------------------------- allreduce

def _eager_bytes(lone: bool) -> int:
    """Largest allreduce that travels with its negotiation (the engine's setting): larger
    for a ``lone`` one, whose caller waits for it at once (see ``EngineConfig``)."""
    engine = _engine
    if engine is None:
        return 0
    return engine.lone_eager_bytes if lone else engine.eager_bytes


def _allreduce_build(array, op, prescale, postscale, inplace: bool, lone: bool = False):
    def build(key: str, members):
        arr = _as_array(array, f"allreduce {key!r}")
        reduce_op = ReduceOp(op)
        source = None
        if inplace:
            if not arr.flags.writeable:
                raise CollectiveArgumentError(f"allreduce_ {key!r}: the array is read-only")
            work = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
        elif prescale != 1.0:
            work = OUTPUTS.empty(arr.shape, arr.dtype)
            np.copyto(work, arr)
        else:
            # Out of place: the backend reads the caller's input where it can and writes
            # a fresh array, instead of copying the input first (see Entry.source). Its
            # memory comes from the output pool, so a repeated allreduce pays no page
            # faults, and it is aligned, so frameworks adopt it uncopied.
            source = np.asarray(arr, order="C")  # (ascontiguousarray would make 0-d 1-d)
            work = OUTPUTS.empty(source.shape, source.dtype)
        check_reduction(work.dtype, reduce_op, prescale, postscale, key)
        if prescale != 1.0:
            if work is arr:
                work = np.array(work, copy=True)  # never scale the caller's data before sending
            scale_in_place(work, prescale)
        payload = None
        if work.nbytes <= _eager_bytes(lone) and reduce_op != ReduceOp.Adasum:
            # Small: the tensor rides on the request and rank 0 reduces it (no ring).
            payload = (work if source is None else source).reshape(-1)
        request = m.Request(key, m.ALLREDUCE, m.dtype_name(work.dtype), work.shape, int(reduce_op),
                            float(prescale), float(postscale), members=members,
                            payload=payload)
        if source is not None:
            return request, work, None, source
        return request, work, (_in_place_finish(arr) if inplace else None)

    return build


def _allreduce_start(array, name, op, prescale: float, postscale: float,
                     process_set: ProcessSet, inplace: bool, lone: bool = False) -> Handle:
    """Start an allreduce (``lone``: the caller waits for it at once, see ``_eager_bytes``)."""
    build = _allreduce_build(array, op, prescale, postscale, inplace, lone)
    return _start(m.ALLREDUCE, name, process_set, build)


def allreduce_async(array: np.ndarray, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allreduce of ``array``; the handle's result is a new array."""
    return _allreduce_start(array, name, op, prescale_factor, postscale_factor, process_set,
                            inplace=False)


def allreduce_async_(array: np.ndarray, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place allreduce: ``array`` itself receives the result."""
    return _allreduce_start(array, name, op, prescale_factor, postscale_factor, process_set,
                            inplace=True)


def _express(array, name, op, prescale: float, postscale: float, process_set: ProcessSet,
             inplace: bool) -> tuple[Any, str | None]:
    """Try the engine's express path for a synchronous allreduce (see
    ``EngineCore.express_allreduce``).

    Returns:
        ``(result, name)``: the result, or None with the name to submit it under (an
        automatic name is taken here, once).
    """
    engine = _engine
    if (engine is None or process_set is not global_process_set or prescale != 1.0
            or type(array) is not np.ndarray):
        return None, name
    name = auto_name(m.ALLREDUCE, name)
    return engine.express_allreduce(name, array, op, postscale, inplace), name


def allreduce(array, name=None, op=ReduceOp.Average, prescale_factor=1.0, postscale_factor=1.0,
              process_set: ProcessSet = global_process_set):
    """Reduce ``array`` across ranks (Average by default) and return a new array."""
    result, name = _express(array, name, op, prescale_factor, postscale_factor, process_set,
                            inplace=False)
    if result is not None:
        return result
    return synchronize(_allreduce_start(array, name, op, prescale_factor, postscale_factor,
                                        process_set, inplace=False, lone=True))


def allreduce_(array, name=None, op=ReduceOp.Average, prescale_factor=1.0, postscale_factor=1.0,
               process_set: ProcessSet = global_process_set):
    """Reduce ``array`` across ranks in place; returns ``array``."""
    result, name = _express(array, name, op, prescale_factor, postscale_factor, process_set,
                            inplace=True)
    if result is not None:
        return result
    return synchronize(_allreduce_start(array, name, op, prescale_factor, postscale_factor,
                                        process_set, inplace=True, lone=True))


def _many(kind: str, keys: list[str], builds: list, members,
          fail_keys: list[str] | None = None) -> list[Handle]:
    """Build and submit several operations as one batch; a local failure fails them all
    (and ``fail_keys`` too, when given instead)."""
    _, engine = _require()
    entries = []
    try:
        for key, build in zip(keys, builds):
            entries.append(_entry(key, build(key, members)))
    except (HvdSparkError, ValueError, TypeError) as exc:
        _fail_locally(kind, fail_keys or keys, exc, members)
    # One batch: the coordinator sees all of them at once and fuses them.
    return engine.submit_many(entries) if entries else []


def _group_names(kind: str, count: int, name, process_set) -> tuple[list[int], str, list[str]]:
    """A grouped call's members, base name and one key per tensor (``<base>.<i>``)."""
    members = _members(process_set, f"grouped {kind}")
    base = auto_name(f"grouped_{kind}", name, process_set)
    return members, base, [f"{base}.{i}" for i in range(count)]


def _check_list(kind: str, arrays) -> None:
    if isinstance(arrays, np.ndarray) or not isinstance(arrays, Sequence):
        raise ConfigError(f"grouped {kind} expects a list of arrays, got {type(arrays).__name__}")


def _grouped(kind: str, arrays, name, process_set, make_build) -> list[Handle]:
    _check_list(kind, arrays)
    members, _, keys = _group_names(kind, len(arrays), name, process_set)
    return _many(kind, keys, [make_build(a) for a in arrays], members)


def allreduce_many_async_(
    arrays: Sequence[np.ndarray], names: Sequence[str], op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[Handle]:
    """Start in-place allreduces of ``arrays`` named ``names``, submitted in one batch.

    Unlike ``grouped_allreduce``, each array keeps its own name and is matched across
    ranks on its own, so ranks may batch different sets of arrays (a DistributedOptimizer's
    buckets can differ between ranks); one request message carries the whole batch.
    """
    if len(arrays) != len(names):
        raise ConfigError(f"allreduce_many_async_ got {len(arrays)} arrays but {len(names)} names")
    members = _members(process_set, "allreduce")
    keys = [auto_name(m.ALLREDUCE, n, process_set) for n in names]
    builds = [_allreduce_build(a, op, prescale_factor, postscale_factor, inplace=True)
              for a in arrays]
    return _many(m.ALLREDUCE, keys, builds, members)


def _grouped_allreduce(arrays, name, op, prescale: float, postscale: float,
                       process_set: ProcessSet, inplace: bool) -> list[Handle]:
    """A grouped allreduce: its small tensors packed into one request, its large ones of
    the same dtype riding on that request uncopied, the others one by one, all in one
    batch (see ``packing``)."""
    _check_list(m.ALLREDUCE, arrays)
    members, base, keys = _group_names(m.ALLREDUCE, len(arrays), name, process_set)
    if not keys:
        return []  # nothing to send (the automatic name is used up on every rank alike)

    def build(a):
        return _allreduce_build(a, op, prescale, postscale, inplace)

    packed = packing.plan(arrays, op, inplace)
    if packed is None:
        return _many(m.ALLREDUCE, keys, [build(a) for a in arrays], members)
    uncopied = packing.uncopied(arrays, packed, prescale)
    on_pack = {*packed, *uncopied}
    alone = [i for i in range(len(arrays)) if i not in on_pack]
    layout = packing.layout_of(arrays, [*packed, *uncopied])
    gathered = packing.gather(arrays, packed,
                              arrays[uncopied[0]].dtype if uncopied else np.float32)
    pack_build = _allreduce_build(gathered, op, prescale, postscale, inplace=True)
    outputs: dict[int, np.ndarray] = {}

    def build_pack(key: str, members):
        if packed or uncopied:  # a refused reduction names a tensor, not the internal key
            check_reduction(gathered.dtype, ReduceOp(op), prescale, postscale,
                            keys[(packed or uncopied)[0]])
        request, work, _ = pack_build(key, members)

        # The large tensors ride behind the packed array, where they lie (in place) or
        # into fresh outputs; a non-contiguous one in a contiguous copy.
        inputs = [_uncopied_input(arrays[i], keys[i], inplace) for i in uncopied]
        copied = [(arrays[i], flat) for i, flat in zip(uncopied, inputs)
                  if inplace and not arrays[i].flags.c_contiguous]

        def finish(result: np.ndarray) -> np.ndarray:
            if inplace:  # when the request completes, as any in-place allreduce
                packing.scatter(result, arrays, packed)
                for target, flat in copied:
                    target[...] = flat.reshape(target.shape)
            return result

        if not uncopied:
            return dataclasses.replace(request, layout=layout), work, finish
        parts, sources = inputs, None
        if not inplace:
            sources, parts = inputs, [OUTPUTS.empty((p.size,), p.dtype) for p in inputs]
            outputs.clear()
            outputs.update(zip(uncopied, parts))
        # The request's shape is the whole; it is never eager.
        total = work.size + sum(p.size for p in parts)
        request = dataclasses.replace(request, layout=layout, shape=(total,), payload=None)
        return Entry(request, Handle(key), work, finish, parts=parts, part_sources=sources)

    pack_key = _pack_key(base)
    handles = _many(m.ALLREDUCE, [pack_key, *(keys[i] for i in alone)],
                    [build_pack, *(build(arrays[i]) for i in alone)], members,
                    fail_keys=[pack_key, *keys])

    def settle(handle: Handle, seconds: float) -> None:
        try:
            _require()[1].wait(handle, seconds)
        except HvdSparkError:
            pass  # the caller gets the packed request's error (or the name stays busy)

    def report(names: list[str], exc: BaseException) -> list[Handle]:
        handles = [report_failure(m.ALLREDUCE, key, exc, members) for key in names]
        return [h for h in handles if h is not None]

    pack = packing.Pack(handles[0], arrays, packed, inplace, report, keys, settle, uncopied,
                        outputs)
    own = dict(zip(alone, handles[1:]))
    return [packing.GuardedHandle(own[i], pack) if i in own else
            packing.PartHandle(keys[i], pack, i) for i in range(len(arrays))]


def _pack_key(base: str) -> str:
    """The name of a grouped allreduce's packed request."""
    return f"{base}.packed"


def report_grouped_failure(kind: str, count: int, name: str | None, exc: BaseException,
                           process_set: ProcessSet = global_process_set) -> None:
    """Tell the other ranks that this rank refused a grouped call of ``count`` tensors.

    For a framework that checks its tensors before handing them to the grouped call:
    the other ranks' copy fails with this rank's reason (whichever of its requests they
    sent: the packed one or a tensor's own) instead of waiting, and the automatic name is
    used up here as there.
    """
    members, base, keys = _group_names(kind, count, name, process_set)
    if kind == m.ALLREDUCE:
        keys = [_pack_key(base), *keys]
    for key in keys:
        report_failure(kind, key, exc, members)


def _uncopied_input(array: np.ndarray, key: str, inplace: bool) -> np.ndarray:
    """A large tensor of a grouped allreduce as its packed request reads it: flat, the
    caller's memory when contiguous (in place the backend writes there too)."""
    if inplace and not array.flags.writeable:
        raise CollectiveArgumentError(f"allreduce_ {key!r}: the array is read-only")
    return np.ascontiguousarray(array).reshape(-1)


def grouped_allreduce_async(
    arrays: Sequence[np.ndarray], name: str | None = None, op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[Handle]:
    """Start allreduces of several arrays as one fused batch; results are new arrays."""
    return _grouped_allreduce(arrays, name, op, prescale_factor, postscale_factor,
                              process_set, inplace=False)


def grouped_allreduce_async_(
    arrays: Sequence[np.ndarray], name: str | None = None, op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[Handle]:
    """Start in-place allreduces of several arrays as one fused batch."""
    return _grouped_allreduce(arrays, name, op, prescale_factor, postscale_factor,
                              process_set, inplace=True)


def grouped_allreduce(arrays, name=None, op=ReduceOp.Average, prescale_factor=1.0,
                      postscale_factor=1.0,
                      process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Allreduce several arrays as one fused operation; returns new arrays."""
    return _wait_all(grouped_allreduce_async(arrays, name, op, prescale_factor,
                                             postscale_factor, process_set))


def grouped_allreduce_(arrays, name=None, op=ReduceOp.Average, prescale_factor=1.0,
                       postscale_factor=1.0,
                       process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Allreduce several arrays in place as one fused operation."""
    return _wait_all(grouped_allreduce_async_(arrays, name, op, prescale_factor,
                                              postscale_factor, process_set))


def _wait_all(handles: list[Handle]) -> list[Any]:
    """Every handle's result; the first error is raised once all finished (so none of a
    failed group is left in flight under its name)."""
    results, error = [], None
    for handle in handles:
        try:
            results.append(synchronize(handle))
        except HvdSparkError as exc:
            error = error or exc
    if error is not None:
        raise error
    return results


# ---------------------------------------------------------------------- the other collectives

def _allgather_build(array):
    def build(key: str, members):
        arr = _as_array(array, f"allgather {key!r}")
        if arr.ndim == 0:
            arr = arr.reshape(1)
        work = np.ascontiguousarray(arr)
        request = m.Request(key, m.ALLGATHER, m.dtype_name(work.dtype), work.shape,
                            members=members)
        return request, work, None

    return build


def allgather_async(array: np.ndarray, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start concatenating every rank's array along dim 0 (first dims may differ)."""
    return _start(m.ALLGATHER, name, process_set, _allgather_build(array))


def allgather(array: np.ndarray, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenate every rank's array along dim 0."""
    return synchronize(allgather_async(array, name, process_set))


def grouped_allgather_async(arrays: Sequence[np.ndarray], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> list[Handle]:
    """Start allgathers of several arrays, submitted together."""
    return _grouped(m.ALLGATHER, arrays, name, process_set, _allgather_build)


def grouped_allgather(arrays: Sequence[np.ndarray], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Allgather several arrays; returns one concatenation per array."""
    return [synchronize(h) for h in grouped_allgather_async(arrays, name, process_set)]


def _broadcast_build(array, root_rank: int, process_set: ProcessSet, inplace: bool):
    def build(key: str, members):
        arr = _as_array(array, f"broadcast {key!r}")
        root = _set_rank(process_set, root_rank, f"broadcast {key!r}")
        if inplace:
            work = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
        else:
            work = np.array(arr, order="C", copy=True)
        request = m.Request(key, m.BROADCAST, m.dtype_name(work.dtype), work.shape, root=root,
                            members=members)
        return request, work, (_in_place_finish(arr) if inplace else None)

    return build


def broadcast_async(array: np.ndarray, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start broadcasting root's ``array``; the result is a new array on every rank."""
    build = _broadcast_build(array, root_rank, process_set, inplace=False)
    return _start(m.BROADCAST, name, process_set, build)


def broadcast_async_(array: np.ndarray, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place broadcast into ``array``."""
    build = _broadcast_build(array, root_rank, process_set, inplace=True)
    return _start(m.BROADCAST, name, process_set, build)


def broadcast(array: np.ndarray, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Return root's ``array`` on every rank (``root_rank`` is a global rank)."""
    return synchronize(broadcast_async(array, root_rank, name, process_set))


def broadcast_(array: np.ndarray, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Overwrite ``array`` with root's, in place."""
    return synchronize(broadcast_async_(array, root_rank, name, process_set))


def alltoall_async(array: np.ndarray, splits: Sequence[int] | None = None,
                   name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start an alltoall; the result is ``(received, received_splits)``."""
    def build(key: str, members):
        arr = _as_array(array, f"alltoall {key!r}")
        if arr.ndim == 0:
            raise CollectiveArgumentError(f"alltoall {key!r} needs a tensor of rank >= 1")
        work = np.ascontiguousarray(arr)
        split_t = None
        if splits is not None:
            raw = np.asarray(splits)
            if raw.dtype.kind not in "iu":
                raise CollectiveArgumentError(
                    f"alltoall {key!r}: splits must be integers, got dtype {raw.dtype}")
            split_t = tuple(int(s) for s in raw.reshape(-1))
        request = m.Request(key, m.ALLTOALL, m.dtype_name(work.dtype), work.shape,
                            splits=split_t, members=members)
        return request, work, None

    return _start(m.ALLTOALL, name, process_set, build)


def alltoall(array, splits=None, name=None,
             process_set: ProcessSet = global_process_set) -> tuple[np.ndarray, np.ndarray]:
    """Send rows ``splits[j]`` to rank j; return what was received and from how many rows."""
    return synchronize(alltoall_async(array, splits, name, process_set))


def _reducescatter_build(array, op, prescale, postscale):
    def build(key: str, members):
        arr = _as_array(array, f"reducescatter {key!r}")
        if arr.ndim == 0:
            raise CollectiveArgumentError(
                f"reducescatter {key!r} needs a tensor of rank >= 1 (it splits dim 0), got a "
                "scalar")
        work = np.array(arr, order="C", copy=True)
        reduce_op = ReduceOp(op)
        if reduce_op == ReduceOp.Adasum:
            raise CollectiveArgumentError(
                f"reducescatter {key!r}: Adasum is only supported by allreduce")
        check_reduction(work.dtype, reduce_op, prescale, postscale, key)
        scale_in_place(work, prescale)
        request = m.Request(key, m.REDUCESCATTER, m.dtype_name(work.dtype), work.shape,
                            int(reduce_op), float(prescale), float(postscale), members=members)
        return request, work, None

    return build


def reducescatter_async(
    array: np.ndarray, name: str | None = None, op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start a reduce-scatter: reduce across ranks, each keeps its block of dim-0 rows."""
    build = _reducescatter_build(array, op, prescale_factor, postscale_factor)
    return _start(m.REDUCESCATTER, name, process_set, build)


def reducescatter(array, name=None, op=ReduceOp.Average, prescale_factor=1.0,
                  postscale_factor=1.0, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce across ranks; return this rank's block of rows (first ranks get extra rows)."""
    return synchronize(reducescatter_async(array, name, op, prescale_factor, postscale_factor,
                                           process_set))


def grouped_reducescatter_async(
    arrays: Sequence[np.ndarray], name: str | None = None, op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[Handle]:
    """Start reduce-scatters of several arrays, submitted together."""
    return _grouped(m.REDUCESCATTER, arrays, name, process_set, lambda a: _reducescatter_build(
        a, op, prescale_factor, postscale_factor))


def grouped_reducescatter(arrays, name=None, op=ReduceOp.Average, prescale_factor=1.0,
                          postscale_factor=1.0,
                          process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Reduce-scatter several arrays; returns this rank's block of each."""
    handles = grouped_reducescatter_async(arrays, name, op, prescale_factor, postscale_factor,
                                          process_set)
    return [synchronize(h) for h in handles]


def barrier(name: str | None = None, process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank (of ``process_set``) has called ``barrier``."""
    def build(key: str, members):
        return m.Request(key, m.BARRIER, members=members), np.empty(0, np.uint8), None

    synchronize(_start(m.BARRIER, name, process_set, build))


def join() -> int:
    """Leave the job's remaining allreduces to the other ranks, as Horovod's ``join``.

    Until every rank has joined, this rank takes part in the other ranks' allreduces
    with zeros (so uneven data never hangs them; Average still divides by the full
    size). Other collectives fail while a rank has joined.

    Returns:
        The last rank to call ``join()``.
    """
    _, engine = _require()
    request = m.Request(m.JOIN_NAME, m.JOIN)
    return synchronize(engine.submit(Entry(request, Handle(m.JOIN_NAME), np.empty(0, np.uint8))))


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return root's ``obj`` on every rank (pickled; only trusted ranks take part)."""
    name = name if name is not None else auto_name("broadcast_object", None, process_set)
    me = rank()
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if me == root_rank else None
    length = np.array([0 if payload is None else payload.size], np.int64)
    length = broadcast(length, root_rank, f"{name}.len", process_set)
    buf = payload if payload is not None else np.empty(int(length[0]), np.uint8)
    data = broadcast(buf, root_rank, f"{name}.data", process_set)
    return obj if me == root_rank else pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return every rank's ``obj`` (of ``process_set``), in rank order."""
    name = name if name is not None else auto_name("allgather_object", None, process_set)
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    lengths = allgather(np.array([payload.size], np.int64), f"{name}.len", process_set)
    data = allgather(payload, f"{name}.data", process_set)
    out, start = [], 0
    for n in lengths.tolist():
        out.append(pickle.loads(data[start : start + n].tobytes()))
        start += n
    return out


# ---------------------------------------------------------------------- process sets

_ADD_PS = "hvd_spark.add_process_set"


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set on every rank (a collective: all ranks call it alike).

    Returns:
        The set, with its ``process_set_id`` assigned.

    Raises:
        ConfigError: Ranks outside the job, or a set with the same ranks exists.
        CollectiveArgumentError: The ranks passed different sets.
    """
    world, _ = _require()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    proposals = allgather_object(ps.ranks, auto_name(_ADD_PS, None))
    if any(p != proposals[0] for p in proposals):
        raise CollectiveArgumentError(
            f"add_process_set: ranks passed different sets ({proposals}); every rank must add "
            "the same process sets in the same order")
    bad = [r for r in ps.ranks if not 0 <= r < world.size]
    if not ps.ranks or bad:
        raise ConfigError(
            f"add_process_set: ranks {ps.ranks} must be a non-empty subset of 0..{world.size - 1}")
    if any(other.ranks == ps.ranks for other in _process_sets.values()):
        raise ConfigError(f"add_process_set: a process set with ranks {ps.ranks} exists already")
    ps._bind(max(_process_sets) + 1, world.rank)
    _process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (a collective); False if it was not added."""
    _require()
    ps_id = process_set.process_set_id
    ids = allgather_object(ps_id, auto_name(_ADD_PS, None))
    if any(i != ids[0] for i in ids):
        raise CollectiveArgumentError(
            f"remove_process_set: ranks removed different process sets (ids {ids})")
    if not ps_id or ps_id not in _process_sets:
        return False
    del _process_sets[ps_id]
    for key in [k for k in _names if k[0] == ps_id]:
        del _names[key]
    process_set._invalidate()
    return True
