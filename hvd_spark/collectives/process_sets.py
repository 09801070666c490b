"""Process sets: collectives among a subset of the ranks (Horovod's ``ProcessSet``).

A set is registered on every rank with the same id (``add_process_set`` is itself a
collective), and its operations are matched only among its members. Ranks passed to
collectives (a broadcast's ``root_rank``) stay global ranks, as in Horovod; results
are in the set's rank order.
"""

from __future__ import annotations

from collections.abc import Iterable

from hvd_spark.errors import ConfigError


class ProcessSet:
    """A subset of the job's ranks that runs collectives among themselves.

    Args:
        ranks (Iterable[int]): Global ranks of the members (any order; kept sorted).

    Attributes:
        process_set_id: Assigned when the set is added (0 is every rank); None before
            that and after removal.
        ranks: Sorted global ranks of the members.
    """

    def __init__(self, ranks: Iterable[int]) -> None:
        ranks = list(ranks)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ConfigError(
                f"ProcessSet takes a list of integer ranks, got {ranks!r} (MPI communicators "
                "are not supported: pass the ranks)")
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"ProcessSet ranks {ranks} contain duplicates")
        self.ranks: list[int] = sorted(ranks)
        self.process_set_id: int | None = None
        self._my_rank: int | None = None

    def bind(self, process_set_id: int, my_rank: int) -> None:
        """Give the set its id on this rank (the registry does, when the set is added)."""
        self.process_set_id = process_set_id
        self._my_rank = my_rank

    def invalidate(self) -> None:
        """Forget the set's id (the registry does, when the set is removed or the job ends)."""
        self.process_set_id = None

    def size(self) -> int | None:
        """Number of members, or None while the set is not added."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This rank's index among the members (-1 outside), or None while not added."""
        if self.process_set_id is None or self._my_rank is None:
            return None
        return self.ranks.index(self._my_rank) if self._my_rank in self.ranks else -1

    def included(self) -> bool | None:
        """True when this rank is a member; None while the set is not added."""
        if self.process_set_id is None or self._my_rank is None:
            return None
        return self._my_rank in self.ranks

    def members(self) -> tuple[int, ...] | None:
        """The members as the engine matches them: None for the global set."""
        return None if self.process_set_id == 0 else tuple(self.ranks)

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


#: Every rank of the job; its ranks are filled in by ``init()``.
global_process_set = ProcessSet([])
