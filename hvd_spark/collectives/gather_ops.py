"""The moving collectives on numpy arrays: allgather, broadcast and alltoall, their
object forms (pickled), and the synchronizing ones, barrier and join.

Each op checks its arguments in a ``build`` function that ``submit`` runs under the
operation's name, so a refused tensor fails on every rank with this rank's reason.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from hvd_spark.collectives import messages as m
from hvd_spark.collectives.operations import Entry, Handle
from hvd_spark.collectives.pairing import pair_payload
from hvd_spark.collectives.process_sets import ProcessSet, global_process_set
from hvd_spark.collectives.session import STATE, rank, require
from hvd_spark.collectives.submit import (
    Build,
    Members,
    as_array,
    auto_name,
    grouped,
    in_place_finish,
    index_in_set,
    start,
    synchronize,
)
from hvd_spark.errors import CollectiveArgumentError


def _paired_payload(kind: str, work: np.ndarray, members: Members,
                    root: int = -1) -> np.ndarray | None:
    """What a broadcast or allgather's request carries when the engine lets two ranks
    decide small ones alone (``pairing``); None otherwise."""
    engine = STATE.engine
    if (engine is None or members is not None or type(work) is not np.ndarray
            or work.nbytes > engine.paired_gather_bytes):
        return None
    return pair_payload(kind, work, root, engine.rank)


def _allgather_build(array: np.ndarray) -> Build:
    def build(key: str, members: Members) -> tuple:
        arr = as_array(array, f"allgather {key!r}")
        if arr.ndim == 0:
            arr = arr.reshape(1)
        work = np.ascontiguousarray(arr)
        request = m.Request(key, m.ALLGATHER, m.dtype_name(work.dtype), work.shape,
                            members=members,
                            payload=_paired_payload(m.ALLGATHER, work, members))
        return request, work, None

    return build


def allgather_async(array: np.ndarray, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start concatenating every rank's array along dim 0 (first dims may differ)."""
    return start(m.ALLGATHER, name, process_set, _allgather_build(array))


def allgather(array: np.ndarray, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenate every rank's array along dim 0."""
    engine = STATE.engine
    if engine is not None and process_set is global_process_set and type(array) is np.ndarray:
        if name is None:
            name = auto_name(m.ALLGATHER, name)
        result = engine.express_allgather(name, array)
        if result is not None:
            return result
    return synchronize(allgather_async(array, name, process_set))


def grouped_allgather_async(arrays: Sequence[np.ndarray], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> list[Handle]:
    """Start allgathers of several arrays, submitted together."""
    return grouped(m.ALLGATHER, arrays, name, process_set, _allgather_build)


def grouped_allgather(arrays: Sequence[np.ndarray], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Allgather several arrays; returns one concatenation per array."""
    return [synchronize(h) for h in grouped_allgather_async(arrays, name, process_set)]


def _broadcast_build(array: np.ndarray, root_rank: int, process_set: ProcessSet,
                     inplace: bool) -> Build:
    def build(key: str, members: Members) -> tuple:
        arr = as_array(array, f"broadcast {key!r}")
        root = index_in_set(process_set, root_rank, f"broadcast {key!r}")
        if inplace:
            work = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
        else:
            work = np.array(arr, order="C", copy=True)
        request = m.Request(key, m.BROADCAST, m.dtype_name(work.dtype), work.shape, root=root,
                            members=members,
                            payload=_paired_payload(m.BROADCAST, work, members, root))
        return request, work, (in_place_finish(arr) if inplace else None)

    return build


def broadcast_async(array: np.ndarray, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start broadcasting root's ``array``; the result is a new array on every rank."""
    build = _broadcast_build(array, root_rank, process_set, inplace=False)
    return start(m.BROADCAST, name, process_set, build)


def broadcast_async_(array: np.ndarray, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place broadcast into ``array``."""
    build = _broadcast_build(array, root_rank, process_set, inplace=True)
    return start(m.BROADCAST, name, process_set, build)


def _express_broadcast(array: np.ndarray, root_rank: int, name: str | None,
                       process_set: ProcessSet,
                       inplace: bool) -> tuple[np.ndarray | None, str | None]:
    """Try the engine's express path for a synchronous broadcast (see
    ``EngineCore.express_broadcast``): ``(result, name)``, or None with the name to
    submit it under (an automatic name is taken here, once)."""
    engine = STATE.engine
    if engine is None or process_set is not global_process_set or type(array) is not np.ndarray:
        return None, name
    if name is None:
        name = auto_name(m.BROADCAST, name)
    return engine.express_broadcast(name, array, root_rank, inplace), name


def broadcast(array: np.ndarray, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Return root's ``array`` on every rank (``root_rank`` is a global rank)."""
    result, name = _express_broadcast(array, root_rank, name, process_set, inplace=False)
    if result is not None:
        return result
    return synchronize(broadcast_async(array, root_rank, name, process_set))


def broadcast_(array: np.ndarray, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Overwrite ``array`` with root's, in place."""
    result, name = _express_broadcast(array, root_rank, name, process_set, inplace=True)
    if result is not None:
        return result
    return synchronize(broadcast_async_(array, root_rank, name, process_set))


def alltoall_async(array: np.ndarray, splits: Sequence[int] | None = None,
                   name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start an alltoall; the result is ``(received, received_splits)``."""
    def build(key: str, members: Members) -> tuple:
        arr = as_array(array, f"alltoall {key!r}")
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

    return start(m.ALLTOALL, name, process_set, build)


def alltoall(array: np.ndarray, splits: Sequence[int] | None = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> tuple[np.ndarray, np.ndarray]:
    """Send rows ``splits[j]`` to rank j; return what was received and from how many rows."""
    return synchronize(alltoall_async(array, splits, name, process_set))


def barrier(name: str | None = None, process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank (of ``process_set``) has called ``barrier``."""
    def build(key: str, members: Members) -> tuple:
        return m.Request(key, m.BARRIER, members=members), np.empty(0, np.uint8), None

    synchronize(start(m.BARRIER, name, process_set, build))


def join() -> int:
    """Leave the job's remaining allreduces to the other ranks, as Horovod's ``join``.

    Until every rank has joined, this rank takes part in the other ranks' allreduces
    with zeros (so uneven data never hangs them; Average still divides by the full
    size). Other collectives fail while a rank has joined.

    Returns:
        The last rank to call ``join()``.
    """
    _, engine = require()
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
    out, offset = [], 0
    for n in lengths.tolist():
        out.append(pickle.loads(data[offset : offset + n].tobytes()))
        offset += n
    return out
