"""The contract every backend fulfils: buffer collectives among a fixed set of ranks.

The engine (negotiation, fusion, handles, object collectives) sits on top and is
shared by all backends; a backend only moves and reduces bytes. Every method is
called by all ranks in the same order with agreeing arguments: the engine
guarantees that before it calls.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence

import numpy as np

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer
from hvd_spark.errors import BackendUnavailableError


class _Waiting(threading.local):
    depth = 0  # per thread: how many caller_waiting blocks it is inside


_waiting = _Waiting()


class caller_waiting:  # noqa: N801 - used like a function: ``with caller_waiting():``
    """Mark this thread as one whose caller waits for the result (the engine wraps a
    waiting caller's progress in it): backends may then poll for their peers' messages
    before blocking. A background thread overlapping the caller's compute must not poll,
    or it takes the CPU that compute needs. (A class, not a generator: it wraps every
    slice of a waiting caller's progress.)"""

    def __enter__(self) -> None:
        _waiting.depth += 1

    def __exit__(self, *exc: object) -> None:
        _waiting.depth -= 1


def may_poll() -> bool:
    """Whether this thread runs a waiting caller's operation (see ``caller_waiting``)."""
    return _waiting.depth > 0


class Communicator(abc.ABC):
    """Buffer collectives among ``size`` ranks.

    Attributes:
        rank: This process's rank.
        size: Number of ranks.
        name: Backend name, for messages and benchmarks.
    """

    rank: int
    size: int
    name: str = "abstract"

    @abc.abstractmethod
    def allreduce(self, buf: SegmentedBuffer, op: ops.ReduceOp) -> None:
        """Reduce ``buf`` element-wise across ranks, in place (Average is summed).

        Backends whose ``reads_source`` is True also take ``source=`` (a SegmentedBuffer
        laid out as ``buf`` holding the inputs) and then need not find them in ``buf``.
        Backends whose ``finishes_segments`` is True also take ``finish=``: a function of
        a list of views that every element of the result must go through exactly once,
        on one rank, before the others receive it (Average's division, a postscale).
        """

    @abc.abstractmethod
    def reducescatter(self, buf: SegmentedBuffer, op: ops.ReduceOp, counts: Sequence[int]) -> None:
        """Reduce so that elements of segment ``rank`` (sizes ``counts``) hold the result."""

    @abc.abstractmethod
    def allgather(self, buf: SegmentedBuffer, counts: Sequence[int]) -> None:
        """Given this rank's segment of ``buf`` filled (sizes ``counts``), fill all segments."""

    @abc.abstractmethod
    def broadcast(self, buf: SegmentedBuffer, root: int) -> None:
        """Overwrite ``buf`` on every rank with root's contents."""

    @abc.abstractmethod
    def alltoall(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        recv: np.ndarray,
        recv_counts: Sequence[int],
    ) -> None:
        """Send block j of ``send`` to rank j; receive rank j's block for us into ``recv``."""

    def subset(self, members: Sequence[int]) -> Communicator:
        """A communicator among ``members`` (global ranks, ascending) for a process set.

        It may share this communicator's connections: the engine runs one operation at a
        time, in the same order on every rank.
        """
        raise BackendUnavailableError(f"the {self.name} backend does not support process sets")

    #: Whether ``allreduce`` accepts ``source=`` (out of place with no copy of the input).
    reads_source = False
    #: Whether ``allreduce`` accepts ``finish=`` (see ``allreduce``).
    finishes_segments = False

    def abort(self) -> None:
        """Make operations blocked in another thread fail now (the job is breaking up).

        Called from a thread other than the engine's; the engine still calls ``close``.
        Backends with nothing to wake (no blocking waits of their own) keep this no-op.
        """
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections; peers blocked on us fail promptly."""
