"""Submission: naming operations, building their engine entries, submitting and waiting.

Every collective goes through here: it gets its engine-level name (the caller's, or the
next automatic one, agreed among the members of its process set), its arguments are
checked by the op's ``build`` function, and a local failure is reported to the other
ranks before it is raised, so they fail with this rank's reason instead of waiting.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

from hvd_spark.collectives import messages as m
from hvd_spark.collectives.operations import Entry, Handle
from hvd_spark.collectives.ops import array_of, check_dtype
from hvd_spark.collectives.process_sets import ProcessSet, global_process_set
from hvd_spark.collectives.session import STATE, require
from hvd_spark.errors import CollectiveArgumentError, ConfigError, HvdSparkError

#: The ranks an operation is matched among (None: every rank, the global set).
Members = tuple[int, ...] | None
#: ``build(key, members)`` returns ``(request, working_array, finish or None)``, for an
#: out-of-place allreduce also the caller's input (``Entry.source``), or a whole Entry.
Build = Callable[[str, Members], Any]


def members_of(process_set: ProcessSet, what: str) -> tuple[int, ...] | None:
    """The engine's member tuple for ``process_set``; raises on a rank outside it."""
    if process_set is global_process_set:
        return None
    world, _ = require()
    if not isinstance(process_set, ProcessSet):
        raise ConfigError(f"{what}: process_set must be a ProcessSet, got {process_set!r}")
    if (process_set.process_set_id is None
            or process_set.process_set_id not in STATE.process_sets):
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
    counter = STATE.names.get((ps_id, kind))
    if counter is None:
        counter = STATE.names[(ps_id, kind)] = itertools.count()
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
    engine = STATE.engine
    if engine is None:
        return None
    request = m.Request(key, kind, members=members, error=f"{type(exc).__name__}: {exc}")
    try:
        return engine.submit(Entry(request, Handle(key), np.empty(0, np.uint8)))
    except HvdSparkError:
        return None  # the name is in flight already (the error is about that), or stopped


def fail_locally(kind: str, keys: list[str], exc: BaseException,
                 members: tuple[int, ...] | None) -> NoReturn:
    """Report ``keys``' local failure to the other ranks, then raise it as the project's error."""
    for key in keys:
        report_failure(kind, key, exc, members)
    if isinstance(exc, HvdSparkError):
        raise exc
    raise CollectiveArgumentError(f"{kind} {keys[0]!r}: {exc}") from exc


def start(kind: str, name: str | None, process_set: ProcessSet, build: Build) -> Handle:
    """Name, validate and submit one operation.

    ``build(key, members)`` returns ``(request, working_array, finish or None)``, and for
    an out-of-place allreduce also the caller's input (``Entry.source``). When it raises,
    the failure is reported to the other ranks before it propagates.
    """
    _, engine = require()
    members = members_of(process_set, kind if name is None else f"{kind} {name!r}")
    key = auto_name(kind, name, process_set)
    try:
        entry = _entry(key, build(key, members))
    except (HvdSparkError, ValueError, TypeError) as exc:
        fail_locally(kind, [key], exc, members)
    return engine.submit(entry)


def submit_many(kind: str, keys: list[str], builds: Sequence[Build],
                members: tuple[int, ...] | None,
                fail_keys: list[str] | None = None) -> list[Handle]:
    """Build and submit several operations as one batch; a local failure fails them all
    (and ``fail_keys`` too, when given instead)."""
    _, engine = require()
    entries = []
    try:
        for key, build in zip(keys, builds):
            entries.append(_entry(key, build(key, members)))
    except (HvdSparkError, ValueError, TypeError) as exc:
        fail_locally(kind, fail_keys or keys, exc, members)
    # One batch: the coordinator sees all of them at once and fuses them.
    return engine.submit_many(entries) if entries else []


def _entry(key: str, built: tuple | Entry) -> Entry:
    """An Entry from what a build function returned (see ``start``; or the Entry)."""
    if isinstance(built, Entry):
        return built
    request, work, finish, *source = built
    entry = Entry(request, Handle(key), work, source=source[0] if source else None)
    if finish is not None:
        entry.finish = finish
    return entry


def group_names(kind: str, count: int, name: str | None,
                process_set: ProcessSet) -> tuple[tuple[int, ...] | None, str, list[str]]:
    """A grouped call's members, base name and one key per tensor (``<base>.<i>``)."""
    members = members_of(process_set, f"grouped {kind}")
    base = auto_name(f"grouped_{kind}", name, process_set)
    return members, base, [f"{base}.{i}" for i in range(count)]


def check_list(kind: str, arrays: Any) -> None:
    """Refuse a grouped call's argument unless it is a list (or tuple) of arrays."""
    if isinstance(arrays, np.ndarray) or not isinstance(arrays, Sequence):
        raise ConfigError(f"grouped {kind} expects a list of arrays, got {type(arrays).__name__}")


def grouped(kind: str, arrays: Sequence[np.ndarray], name: str | None,
            process_set: ProcessSet, make_build: Callable[[np.ndarray], Build]) -> list[Handle]:
    """Submit one ``kind`` operation per array as one batch, named ``<base>.<i>``."""
    check_list(kind, arrays)
    members, _, keys = group_names(kind, len(arrays), name, process_set)
    return submit_many(kind, keys, [make_build(a) for a in arrays], members)


def as_array(value: Any, what: str) -> np.ndarray:
    """``value`` as a numpy array of a supported dtype; raises for anything else."""
    array = array_of(value)
    if array is None:
        raise CollectiveArgumentError(
            f"{what} expects a numpy array, got {type(value).__name__}; "
            "use the torch/tensorflow bindings for framework tensors"
        )
    check_dtype(array.dtype, what)
    return array


def in_place_finish(target: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """A finish function copying the result into ``target`` (unless it already is it)."""
    def finish(result: np.ndarray) -> np.ndarray:
        if result is not target:
            target[...] = result.reshape(target.shape)
        return target

    return finish


def index_in_set(process_set: ProcessSet, global_rank: int, what: str) -> int:
    """A global root rank as its index in ``process_set`` (Horovod passes global ranks)."""
    if process_set is global_process_set:
        return int(global_rank)
    if int(global_rank) not in process_set.ranks:
        raise CollectiveArgumentError(
            f"{what}: root_rank {global_rank} is not a member of {process_set}")
    return process_set.ranks.index(int(global_rank))


def synchronize(handle: Handle) -> Any:
    """Wait for an async operation and return its result (raises its error)."""
    return require()[1].wait(handle)


def poll(handle: Handle) -> bool:
    """True when the async operation has finished."""
    if handle.done():
        return True
    # A caller polling in a tight loop would hold the GIL that the engine's threads need
    # to finish the operation (each wait for it up to the 5 ms switch interval).
    time.sleep(0)
    return handle.done()


def wait_all(handles: list[Handle]) -> list[Any]:
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
