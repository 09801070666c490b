"""The framework-free collectives API on numpy arrays (Horovod's names and semantics).

Configuration comes from the environment the launchers set; users only call
``init()``. Every blocking call has a deadline (HVD_SPARK_TIMEOUT).
"""

from __future__ import annotations

import atexit
import itertools
import pickle
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from hvd_spark import _env
from hvd_spark.collectives import messages as m
from hvd_spark.collectives import registry
from hvd_spark.collectives.engine import Engine
from hvd_spark.collectives.operations import Entry, Handle
from hvd_spark.collectives.ops import ReduceOp, check_dtype, check_reduction, scale_in_place
from hvd_spark.collectives.tcp import wire
from hvd_spark.collectives.tcp.mesh import build_mesh
from hvd_spark.collectives.tcp.store import StoreClient
from hvd_spark.config import DEFAULT_START_TIMEOUT_S, EngineConfig, WorldInfo
from hvd_spark.errors import CollectiveError, ConfigError

_lock = threading.Lock()
_world: WorldInfo | None = None
_engine: Engine | None = None
_epoch = itertools.count()
_names = itertools.count()


def init() -> None:
    """Join the job: connect to every other rank. Safe to call more than once."""
    global _world, _engine
    with _lock:
        if _engine is not None:
            return
        world = WorldInfo.from_env()
        config = EngineConfig.from_env()
        factory = registry.resolve(_env.get_str(_env.BACKEND, "auto") or "auto")
        start_timeout = _env.get_float(_env.START_TIMEOUT, DEFAULT_START_TIMEOUT_S)
        store = StoreClient(wire.parse_addr(world.rendezvous_addr), world.secret, start_timeout)
        try:
            mesh = build_mesh(
                world.rank, world.size, store, world.secret, world.hostname,
                world.advertise_addr, start_timeout, next(_epoch),
            )
        finally:
            store.close()
        for sock in [*mesh.data.values(), *mesh.control.values()]:
            sock.settimeout(config.timeout)
        comm = factory(world, config, mesh.data)
        _engine = Engine(world.rank, world.size, comm, mesh.control, config)
        _world = world
    atexit.register(shutdown)


def shutdown() -> None:
    """Leave the job (waits briefly for the other ranks to leave too)."""
    global _world, _engine
    with _lock:
        engine, _engine, _world = _engine, None, None
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


def backend_name() -> str:
    """Name of the backend moving the bytes (e.g. "tcp")."""
    return _require()[1].comm.name


def _auto_name(kind: str, name: str | None) -> str:
    return name if name is not None else f"{kind}.noname.{next(_names)}"


def _as_array(array: Any, what: str) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        if isinstance(array, (int, float, bool, np.generic)):
            array = np.asarray(array)
        else:
            raise CollectiveError(
                f"{what} expects a numpy array, got {type(array).__name__}; "
                "use the torch/tensorflow bindings for framework tensors"
            )
    check_dtype(array.dtype, what)
    return array


def _submit(request: m.Request, array: np.ndarray, finish=None) -> Handle:
    _, engine = _require()
    entry = Entry(request, Handle(request.name), array)
    if finish is not None:
        entry.finish = finish
    return engine.submit(entry)


def synchronize(handle: Handle) -> Any:
    """Wait for an async operation and return its result (raises its error)."""
    return _require()[1].wait(handle)


def poll(handle: Handle) -> bool:
    """True when the async operation has finished."""
    return handle.done()


def _in_place_finish(target: np.ndarray):
    def finish(result: np.ndarray) -> np.ndarray:
        if result is not target:
            target[...] = result.reshape(target.shape)
        return target

    return finish


_DTYPE_NAMES: dict[np.dtype, str] = {}


def _dtype_name(dtype: np.dtype) -> str:
    # numpy 2 computes dtype.name in Python (about 5 us); gradients ask for it every step.
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name
    return name


def _allreduce_entry(array, name, op, prescale, postscale, inplace: bool) -> Entry:
    """Validate and prepare one rank's allreduce of ``array``."""
    name = _auto_name(m.ALLREDUCE, name)
    array = _as_array(array, f"allreduce {name!r}")
    op = ReduceOp(op)
    if inplace:
        if not array.flags.writeable:
            raise CollectiveError(f"allreduce_ {name!r}: the array is read-only")
        work = array if array.flags.c_contiguous else np.ascontiguousarray(array)
    else:
        work = np.array(array, order="C", copy=True)
    if prescale != 1.0:
        check_reduction(work.dtype, op, prescale, postscale, name)
        if work is array:
            work = np.array(work, copy=True)  # never scale the caller's data before sending
        scale_in_place(work, prescale)
    request = m.Request(name, m.ALLREDUCE, _dtype_name(work.dtype), work.shape, int(op),
                        float(prescale), float(postscale))
    entry = Entry(request, Handle(name), work)
    if inplace:
        entry.finish = _in_place_finish(array)
    return entry


def allreduce_async(
    array: np.ndarray,
    name: str | None = None,
    op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start an allreduce of ``array``; the handle's result is a new array."""
    entry = _allreduce_entry(array, name, op, prescale_factor, postscale_factor, inplace=False)
    return _require()[1].submit(entry)


def allreduce_async_(
    array: np.ndarray,
    name: str | None = None,
    op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start an in-place allreduce: ``array`` itself receives the result."""
    entry = _allreduce_entry(array, name, op, prescale_factor, postscale_factor, inplace=True)
    return _require()[1].submit(entry)


def allreduce(array, name=None, op=ReduceOp.Average, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``array`` across ranks (Average by default) and return a new array."""
    return synchronize(allreduce_async(array, name, op, prescale_factor, postscale_factor))


def allreduce_(array, name=None, op=ReduceOp.Average, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``array`` across ranks in place; returns ``array``."""
    return synchronize(allreduce_async_(array, name, op, prescale_factor, postscale_factor))


def _grouped(arrays, name, op, prescale, postscale, inplace: bool) -> list[Handle]:
    base = _auto_name("grouped_allreduce", name)
    entries = [_allreduce_entry(a, f"{base}.{i}", op, prescale, postscale, inplace)
               for i, a in enumerate(arrays)]
    # One batch: the coordinator sees all of them at once and fuses them.
    return _require()[1].submit_many(entries) if entries else []


def allreduce_many_async_(
    arrays: Sequence[np.ndarray], names: Sequence[str], op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> list[Handle]:
    """Start in-place allreduces of ``arrays`` named ``names``, submitted in one batch.

    Unlike ``grouped_allreduce``, each array keeps its own name and is matched across
    ranks on its own, so ranks may batch different sets of arrays (a DistributedOptimizer's
    buckets can differ between ranks); one request message carries the whole batch.
    """
    if len(arrays) != len(names):
        raise ConfigError(f"allreduce_many_async_ got {len(arrays)} arrays but {len(names)} names")
    entries = [_allreduce_entry(a, n, op, prescale_factor, postscale_factor, inplace=True)
               for a, n in zip(arrays, names)]
    return _require()[1].submit_many(entries) if entries else []


def grouped_allreduce_async(
    arrays: Sequence[np.ndarray], name: str | None = None, op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> list[Handle]:
    """Start allreduces of several arrays as one fused batch; results are new arrays."""
    return _grouped(arrays, name, op, prescale_factor, postscale_factor, inplace=False)


def grouped_allreduce_async_(
    arrays: Sequence[np.ndarray], name: str | None = None, op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> list[Handle]:
    """Start in-place allreduces of several arrays as one fused batch."""
    return _grouped(arrays, name, op, prescale_factor, postscale_factor, inplace=True)


def grouped_allreduce(arrays, name=None, op=ReduceOp.Average, prescale_factor=1.0,
                      postscale_factor=1.0) -> list[np.ndarray]:
    """Allreduce several arrays as one fused operation; returns new arrays."""
    handles = grouped_allreduce_async(arrays, name, op, prescale_factor, postscale_factor)
    return [synchronize(h) for h in handles]


def grouped_allreduce_(arrays, name=None, op=ReduceOp.Average, prescale_factor=1.0,
                       postscale_factor=1.0) -> list[np.ndarray]:
    """Allreduce several arrays in place as one fused operation."""
    handles = grouped_allreduce_async_(arrays, name, op, prescale_factor, postscale_factor)
    return [synchronize(h) for h in handles]


def allgather_async(array: np.ndarray, name: str | None = None) -> Handle:
    """Start concatenating every rank's array along dim 0 (first dims may differ)."""
    name = _auto_name(m.ALLGATHER, name)
    array = _as_array(array, f"allgather {name!r}")
    if array.ndim == 0:
        array = array.reshape(1)
    work = np.ascontiguousarray(array)
    return _submit(m.Request(name, m.ALLGATHER, _dtype_name(work.dtype), work.shape), work)


def allgather(array: np.ndarray, name: str | None = None) -> np.ndarray:
    """Concatenate every rank's array along dim 0."""
    return synchronize(allgather_async(array, name))


def broadcast_async(array: np.ndarray, root_rank: int, name: str | None = None) -> Handle:
    """Start broadcasting root's ``array``; the result is a new array on every rank."""
    name = _auto_name(m.BROADCAST, name)
    array = _as_array(array, f"broadcast {name!r}")
    work = np.array(array, order="C", copy=True)
    request = m.Request(name, m.BROADCAST, _dtype_name(work.dtype), work.shape, root=int(root_rank))
    return _submit(request, work)


def broadcast_async_(array: np.ndarray, root_rank: int, name: str | None = None) -> Handle:
    """Start an in-place broadcast into ``array``."""
    name = _auto_name(m.BROADCAST, name)
    array = _as_array(array, f"broadcast {name!r}")
    work = array if array.flags.c_contiguous else np.ascontiguousarray(array)
    request = m.Request(name, m.BROADCAST, _dtype_name(work.dtype), work.shape, root=int(root_rank))
    return _submit(request, work, _in_place_finish(array))


def broadcast(array: np.ndarray, root_rank: int, name: str | None = None) -> np.ndarray:
    """Return root's ``array`` on every rank."""
    return synchronize(broadcast_async(array, root_rank, name))


def broadcast_(array: np.ndarray, root_rank: int, name: str | None = None) -> np.ndarray:
    """Overwrite ``array`` with root's, in place."""
    return synchronize(broadcast_async_(array, root_rank, name))


def alltoall_async(
    array: np.ndarray, splits: Sequence[int] | None = None, name: str | None = None
) -> Handle:
    """Start an alltoall; the result is ``(received, received_splits)``."""
    name = _auto_name(m.ALLTOALL, name)
    array = _as_array(array, f"alltoall {name!r}")
    work = np.ascontiguousarray(array)
    split_t = None if splits is None else tuple(int(s) for s in np.asarray(splits).reshape(-1))
    request = m.Request(name, m.ALLTOALL, _dtype_name(work.dtype), work.shape, splits=split_t)
    return _submit(request, work)


def alltoall(array, splits=None, name=None) -> tuple[np.ndarray, np.ndarray]:
    """Send rows ``splits[j]`` to rank j; return what was received and from how many rows."""
    return synchronize(alltoall_async(array, splits, name))


def reducescatter_async(
    array: np.ndarray, name: str | None = None, op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> Handle:
    """Start a reduce-scatter: reduce across ranks, each keeps its block of dim-0 rows."""
    name = _auto_name(m.REDUCESCATTER, name)
    array = _as_array(array, f"reducescatter {name!r}")
    work = np.array(array, order="C", copy=True)
    if work.ndim == 0:
        work = work.reshape(1)
    op = ReduceOp(op)
    request = m.Request(name, m.REDUCESCATTER, _dtype_name(work.dtype), work.shape, int(op),
                        float(prescale_factor), float(postscale_factor))
    if prescale_factor != 1.0:
        check_reduction(work.dtype, op, prescale_factor, postscale_factor, name)
        scale_in_place(work, prescale_factor)
    return _submit(request, work)


def reducescatter(array, name=None, op=ReduceOp.Average, prescale_factor=1.0,
                  postscale_factor=1.0) -> np.ndarray:
    """Reduce across ranks; return this rank's block of rows (first ranks get extra rows)."""
    return synchronize(reducescatter_async(array, name, op, prescale_factor, postscale_factor))


def barrier(name: str | None = None) -> None:
    """Return once every rank has called ``barrier``."""
    name = _auto_name(m.BARRIER, name)
    synchronize(_submit(m.Request(name, m.BARRIER), np.empty(0, np.uint8)))


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str | None = None) -> Any:
    """Return root's ``obj`` on every rank (pickled; only trusted ranks take part)."""
    name = _auto_name("broadcast_object", name)
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if rank() == root_rank else None
    length = np.array([0 if payload is None else payload.size], np.int64)
    length = broadcast(length, root_rank, f"{name}.len")
    buf = payload if payload is not None else np.empty(int(length[0]), np.uint8)
    data = broadcast(buf, root_rank, f"{name}.data")
    return obj if rank() == root_rank else pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Return every rank's ``obj``, in rank order."""
    name = _auto_name("allgather_object", name)
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    lengths = allgather(np.array([payload.size], np.int64), f"{name}.len")
    data = allgather(payload, f"{name}.data")
    out, start = [], 0
    for n in lengths.tolist():
        out.append(pickle.loads(data[start : start + n].tobytes()))
        start += n
    return out
