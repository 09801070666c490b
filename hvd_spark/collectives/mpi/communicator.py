"""Buffer collectives over MPI's non-blocking collectives (mpi4py), with deadlines.

Native MPI reductions serve the dtypes MPI knows; float16, bfloat16 and bool reduce
through a user-defined MPI operation built on ``ops.reduce_into``, so every dtype the
engine accepts gives the same result as on the TCP backend.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer, offsets
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.mpi.waiting import AbortChannel, wait
from hvd_spark.errors import CollectiveError

# MPI counts are C ints: larger buffers go in pieces (reductions, broadcasts) or fail clearly.
_MAX_COUNT = 2**31 - 1
_CHUNK_ELEMS = 1 << 28

_NATIVE_TYPES = {
    np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.int8): MPI.INT8_T, np.dtype(np.int16): MPI.INT16_T,
    np.dtype(np.int32): MPI.INT32_T, np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.uint8): MPI.UINT8_T, np.dtype(np.uint16): MPI.UINT16_T,
    np.dtype(np.uint32): MPI.UINT32_T, np.dtype(np.uint64): MPI.UINT64_T,
}
_NATIVE_OPS = {ops.Sum: MPI.SUM, ops.Average: MPI.SUM, ops.Min: MPI.MIN, ops.Max: MPI.MAX,
               ops.Product: MPI.PROD}
# Carriers of the same width for the dtypes reduced by our own MPI operation.
_CARRIERS = {1: MPI.UINT8_T, 2: MPI.UINT16_T}
_user_ops: dict[tuple[np.dtype, ops.ReduceOp], Any] = {}


def _user_op(dtype: np.dtype, op: ops.ReduceOp) -> Any:
    """An MPI operation reducing ``dtype`` with numpy (float16, bfloat16, bool)."""
    key = (dtype, op)
    if key not in _user_ops:
        def reduce(inbuf, inoutbuf, _datatype, dtype=dtype, op=op):
            src = np.frombuffer(inbuf, dtype)
            dst = np.frombuffer(inoutbuf, dtype)
            ops.reduce_into(dst, src, op)

        _user_ops[key] = MPI.Op.Create(reduce, commute=True)
    return _user_ops[key]


def reduction_of(dtype: np.dtype, op: ops.ReduceOp) -> tuple[Any, Any]:
    """The ``(MPI datatype, MPI op)`` that reduce ``dtype`` with ``op``."""
    native = _NATIVE_TYPES.get(dtype)
    if native is not None and op in _NATIVE_OPS:
        return native, _NATIVE_OPS[op]
    if dtype.itemsize not in _CARRIERS or op not in _NATIVE_OPS:
        raise CollectiveError(f"the MPI backend cannot reduce dtype {dtype} with {op!r}")
    return _CARRIERS[dtype.itemsize], _user_op(dtype, op)


def _element_type(itemsize: int) -> Any:
    """A committed MPI datatype of ``itemsize`` bytes, for moving whole elements."""
    if itemsize not in _element_types:
        _element_types[itemsize] = MPI.BYTE.Create_contiguous(itemsize).Commit()
    return _element_types[itemsize]


_element_types: dict[int, Any] = {}


def _check_counts(counts: Sequence[int], what: str) -> None:
    if max(counts, default=0) > _MAX_COUNT or sum(counts) > _MAX_COUNT:
        raise CollectiveError(f"{what}: more than {_MAX_COUNT} elements in one MPI call; split "
                              "the tensor")


class MpiCommunicator(Communicator):
    """Collectives among the ranks of an MPI communicator.

    Args:
        comm: The MPI communicator for data (duplicated: nobody else uses it).
        timeout: Seconds any collective may wait for its peers.
        abort: The abort channel shared by all communicators of the job.
        owns_abort: Closing this communicator notifies the peers (the world's does; a
            process set's view does not).
    """

    name = "mpi"

    def __init__(self, comm: Any, timeout: float, abort: AbortChannel,
                 owns_abort: bool = True) -> None:
        self.mpi_comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timeout = timeout
        self.channel = abort
        self._owns_abort = owns_abort
        self._closed = False

    # ------------------------------------------------------------------ plumbing

    def _run(self, start, what: str) -> None:
        if self._closed:
            raise CollectiveError(f"{what}: the MPI communicator of rank {self.rank} is closed")
        if self.channel.notice is not None:
            raise CollectiveError(f"{what} cannot run: {self.channel.notice}")
        wait(start(), time.monotonic() + self.timeout, self.channel, f"MPI {what}")

    @staticmethod
    def _flat(buf: SegmentedBuffer) -> tuple[np.ndarray, bool]:
        """One contiguous array holding ``buf`` (a copy when it has several pieces)."""
        if len(buf.pieces) == 1:
            return buf.pieces[0], False
        return np.concatenate(buf.pieces), True

    @staticmethod
    def _scatter_back(buf: SegmentedBuffer, flat: np.ndarray) -> None:
        start = 0
        for piece in buf.pieces:
            piece[...] = flat[start : start + piece.size]
            start += piece.size

    # ------------------------------------------------------------------ the contract

    def allreduce(self, buf: SegmentedBuffer, op: ops.ReduceOp) -> None:
        if self.size == 1 or buf.size == 0:
            return
        flat, copied = self._flat(buf)
        mtype, mop = reduction_of(buf.dtype, ops.ReduceOp(op))
        for lo in range(0, flat.size, _CHUNK_ELEMS):
            part = flat[lo : lo + _CHUNK_ELEMS]
            self._run(lambda part=part: self.mpi_comm.Iallreduce(
                MPI.IN_PLACE, [part, part.size, mtype], mop), "allreduce")
        if copied:
            self._scatter_back(buf, flat)

    def reducescatter(self, buf: SegmentedBuffer, op: ops.ReduceOp, counts: Sequence[int]) -> None:
        if self.size == 1 or buf.size == 0:
            return
        _check_counts(counts, "reducescatter")
        flat, copied = self._flat(buf)
        mtype, mop = reduction_of(buf.dtype, ops.ReduceOp(op))
        mine = np.empty(counts[self.rank], flat.dtype)
        self._run(lambda: self.mpi_comm.Ireduce_scatter(
            [flat, flat.size, mtype], [mine, mine.size, mtype], list(counts), mop),
            "reducescatter")
        start = offsets(counts)[self.rank]
        flat[start : start + mine.size] = mine
        if copied:
            self._scatter_back(buf, flat)

    def allgather(self, buf: SegmentedBuffer, counts: Sequence[int]) -> None:
        if self.size == 1 or buf.size == 0:
            return
        _check_counts(counts, "allgather")
        flat, copied = self._flat(buf)
        etype = _element_type(flat.itemsize)
        self._run(lambda: self.mpi_comm.Iallgatherv(
            MPI.IN_PLACE, [flat, (list(counts), offsets(counts)), etype]), "allgather")
        if copied:
            self._scatter_back(buf, flat)

    def broadcast(self, buf: SegmentedBuffer, root: int) -> None:
        if self.size == 1 or buf.size == 0:
            return
        flat, copied = self._flat(buf)
        raw = flat.view(np.uint8)
        step = _CHUNK_ELEMS * 4
        for lo in range(0, raw.size, step):
            part = raw[lo : lo + step]
            self._run(lambda part=part: self.mpi_comm.Ibcast([part, part.size, MPI.BYTE],
                                                             root), "broadcast")
        if copied and self.rank != root:
            self._scatter_back(buf, flat)

    def alltoall(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        recv: np.ndarray,
        recv_counts: Sequence[int],
    ) -> None:
        if self.size == 1:
            recv[: send_counts[0]] = send[: send_counts[0]]
            return
        _check_counts(send_counts, "alltoall")
        _check_counts(recv_counts, "alltoall")
        etype = _element_type(send.itemsize)
        self._run(lambda: self.mpi_comm.Ialltoallv(
            [send, (list(send_counts), offsets(send_counts)), etype],
            [recv, (list(recv_counts), offsets(recv_counts)), etype]), "alltoall")

    def subset(self, members: Sequence[int]) -> MpiCommunicator:
        """An MPI communicator among ``members`` (only they call this, in the same order)."""
        group = self.mpi_comm.Get_group().Incl(list(members))
        sub = self.mpi_comm.Create_group(group, tag=11)
        group.Free()
        return MpiCommunicator(sub, self.timeout, self.channel, owns_abort=False)

    def abort(self) -> None:
        """Make a wait in the engine thread fail now (another thread saw the job break)."""
        self.channel.interrupt("the job is breaking up (aborted on this rank)")

    def finish(self) -> None:
        """Close after a clean, collective goodbye: nobody is waiting, so nobody is told."""
        self._closed = True

    def close(self) -> None:
        """Stop; peers still waiting on us are told at once (their waits fail)."""
        if self._closed:
            return
        self._closed = True
        if self._owns_abort:
            self.channel.send(f"rank {self.rank} closed its MPI communicator")
