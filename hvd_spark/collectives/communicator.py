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
from typing import Protocol

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


class ExpressLane(Protocol):
    """Shared memory two ranks on one host post tensors on, for an engine's express path
    (the TCP backend's is ``tcp.express_lane.ExpressLane``)."""

    def can_post(self, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` fits a free buffer now."""

    def post(self, flat: np.ndarray) -> int:
        """Copy ``flat`` into a free buffer; its sequence number names it to the peer."""

    def view(self, seq: int, dtype: str, count: int) -> np.ndarray:
        """The peer's tensor ``seq``, in place, until ``release(seq)``."""

    def release(self, seq: int) -> None:
        """Hand the peer's buffer ``seq`` back (it was read)."""

    def close(self) -> None:
        """Unmap the buffers."""


class Communicator(abc.ABC):
    """Buffer collectives among ``size`` ranks.

    A backend declares what it can do beyond the contract in the capability attributes
    below (class attributes it overrides); the engine reads them, and never probes a
    backend for methods or attributes.

    Attributes:
        rank: This process's rank.
        size: Number of ranks.
        name: Backend name, for messages and benchmarks.
        reads_source: ``allreduce`` takes ``source=`` (see ``allreduce``): out of place
            with no copy of the input first.
        finishes_segments: ``allreduce`` takes ``finish=`` (see ``allreduce``).
        tunes_chunks: ``set_chunk_bytes`` changes how the backend cuts buffers, between
            operations (the autotuner tunes the chunk size only then).
        express_lane: Two ranks sharing a host: the lane an engine's express path posts
            tensors on; None where there is none.
    """

    rank: int
    size: int
    name: str = "abstract"
    reads_source: bool = False
    finishes_segments: bool = False
    tunes_chunks: bool = False
    express_lane: ExpressLane | None = None

    @abc.abstractmethod
    def allreduce(self, buf: SegmentedBuffer, op: ops.ReduceOp) -> None:
        """Reduce ``buf`` element-wise across ranks, in place (Average is summed).

        Backends whose ``reads_source`` is True also take ``source=`` (a SegmentedBuffer
        laid out as ``buf`` holding the inputs) and then need not find them in ``buf``.
        Backends whose ``finishes_segments`` is True also take ``finish=``: a function of
        a list of views that every element of the result must go through exactly once,
        on one rank, before the others receive it (Average's division, a postscale).

        Raises:
            PeerDisconnectedError: A peer closed its connection or died meanwhile.
            CollectiveTimeoutError: A peer sent nothing within the collective timeout.
            CollectiveError: The backend failed otherwise (its library reported an error).
        """

    @abc.abstractmethod
    def reducescatter(self, buf: SegmentedBuffer, op: ops.ReduceOp, counts: Sequence[int]) -> None:
        """Reduce so that elements of segment ``rank`` (sizes ``counts``) hold the result.

        Raises:
            PeerDisconnectedError: A peer closed its connection or died meanwhile.
            CollectiveTimeoutError: A peer sent nothing within the collective timeout.
            CollectiveError: The backend failed otherwise (its library reported an error).
        """

    @abc.abstractmethod
    def allgather(self, buf: SegmentedBuffer, counts: Sequence[int]) -> None:
        """Given this rank's segment of ``buf`` filled (sizes ``counts``), fill all segments.

        Raises:
            PeerDisconnectedError: A peer closed its connection or died meanwhile.
            CollectiveTimeoutError: A peer sent nothing within the collective timeout.
            CollectiveError: The backend failed otherwise (its library reported an error).
        """

    @abc.abstractmethod
    def broadcast(self, buf: SegmentedBuffer, root: int) -> None:
        """Overwrite ``buf`` on every rank with root's contents.

        Raises:
            PeerDisconnectedError: A peer closed its connection or died meanwhile.
            CollectiveTimeoutError: A peer sent nothing within the collective timeout.
            CollectiveError: The backend failed otherwise (its library reported an error).
        """

    @abc.abstractmethod
    def alltoall(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        recv: np.ndarray,
        recv_counts: Sequence[int],
    ) -> None:
        """Send block j of ``send`` to rank j; receive rank j's block for us into ``recv``.

        Raises:
            PeerDisconnectedError: A peer closed its connection or died meanwhile.
            CollectiveTimeoutError: A peer sent nothing within the collective timeout.
            CollectiveError: The backend failed otherwise (its library reported an error).
        """

    def subset(self, members: Sequence[int]) -> Communicator:
        """A communicator among ``members`` (global ranks, ascending) for a process set.

        It may share this communicator's connections: the engine runs one operation at a
        time, in the same order on every rank.

        Raises:
            BackendUnavailableError: The backend has no process sets.
        """
        raise BackendUnavailableError(f"the {self.name} backend does not support process sets")

    def set_chunk_bytes(self, chunk_bytes: int) -> None:
        """Cut buffers into chunks of ``chunk_bytes`` from the next operation on (every
        rank switches at the same point of the operation order).

        Raises:
            BackendUnavailableError: The backend cuts no chunks (``tunes_chunks`` False).
            CollectiveError: ``chunk_bytes`` does not fit the backend's buffers.
        """
        raise BackendUnavailableError(
            f"the {self.name} backend has no chunk size to set ({chunk_bytes} bytes asked)")

    def abort(self) -> None:
        """Make operations blocked in another thread fail now (the job is breaking up).

        Called from a thread other than the engine's; the engine still calls ``close``.
        Backends with nothing to wake (no blocking waits of their own) keep this no-op.
        """
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections; peers blocked on us fail promptly (a connection broken
        already is released all the same).

        Raises:
            Exception: Only a device library's own error where freeing its resources
                fails (NCCL, CUDA IPC); the host backends (TCP, MPI) raise nothing here.
        """
