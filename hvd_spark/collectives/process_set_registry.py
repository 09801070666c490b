"""The registry of process sets on this rank: adding and removing them (collectives).

A set is registered on every rank with the same id; ``add_process_set`` and
``remove_process_set`` are collectives, so all ranks must call them alike. The registry
itself lives in the session (``STATE.process_sets``), which ``init()`` starts with the
global set and ``shutdown()`` empties.
"""

from __future__ import annotations

from collections.abc import Sequence

from hvd_spark.collectives.gather_ops import allgather_object
from hvd_spark.collectives.process_sets import ProcessSet, global_process_set
from hvd_spark.collectives.session import STATE, require
from hvd_spark.collectives.submit import auto_name
from hvd_spark.config import WorldInfo
from hvd_spark.errors import CollectiveArgumentError, ConfigError

_ADD_PS = "hvd_spark.add_process_set"


def start_registry(world: WorldInfo) -> None:
    """Begin a new job's registry with only the global set (every rank of ``world``)."""
    STATE.process_sets.clear()
    global_process_set.ranks = list(range(world.size))
    global_process_set.bind(0, world.rank)
    STATE.process_sets[0] = global_process_set


def clear_registry() -> None:
    """Forget every added set (the job ends): their ids no longer name anything."""
    for ps in STATE.process_sets.values():
        if ps is not global_process_set:
            ps.invalidate()
    STATE.process_sets.clear()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set on every rank (a collective: all ranks call it alike).

    Returns:
        The set, with its ``process_set_id`` assigned.

    Raises:
        ConfigError: Ranks outside the job, or a set with the same ranks exists.
        CollectiveArgumentError: The ranks passed different sets.
    """
    world, _ = require()
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
    if any(other.ranks == ps.ranks for other in STATE.process_sets.values()):
        raise ConfigError(f"add_process_set: a process set with ranks {ps.ranks} exists already")
    ps.bind(max(STATE.process_sets) + 1, world.rank)
    STATE.process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (a collective); False if it was not added."""
    require()
    ps_id = process_set.process_set_id
    ids = allgather_object(ps_id, auto_name(_ADD_PS, None))
    if any(i != ids[0] for i in ids):
        raise CollectiveArgumentError(
            f"remove_process_set: ranks removed different process sets (ids {ids})")
    if not ps_id or ps_id not in STATE.process_sets:
        return False
    del STATE.process_sets[ps_id]
    for key in [k for k in STATE.names if k[0] == ps_id]:
        del STATE.names[key]
    process_set.invalidate()
    return True
