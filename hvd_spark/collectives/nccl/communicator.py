"""Buffer collectives on CUDA device memory through NCCL (cupy's bindings).

One rank per GPU. Every call is queued on the device's collective stream and returns
without waiting for the GPU (the caller orders its consumers after ``done_event``).
Data types NCCL lacks (int16, uint16) never come here: the device-aware layer stages
them through the host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer, offsets
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.nccl import library, streams
from hvd_spark.collectives.nccl.exchange import (
    broadcast_unique_id,
    id_from_tuple,
    id_to_tuple,
)
from hvd_spark.collectives.nccl.fusion import FusionBuffer
from hvd_spark.errors import CollectiveError

log = logging.getLogger(__name__)

# How long close() lets queued NCCL work finish before aborting it.
_CLOSE_WAIT_S = 30.0

_NCCL_TYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
               "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
               "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64",
               "bool": "NCCL_UINT8"}
_NCCL_OPS = {ops.Sum: "NCCL_SUM", ops.Average: "NCCL_SUM", ops.Min: "NCCL_MIN",
             ops.Max: "NCCL_MAX", ops.Product: "NCCL_PROD"}
# A bool is one byte of 0 or 1: or is max, and is min (Sum is or, Product is and).
_BOOL_OPS = {ops.Sum: ops.Max, ops.Max: ops.Max, ops.Min: ops.Min, ops.Product: ops.Min}


def supports(dtype: np.dtype) -> bool:
    """True when NCCL reduces ``dtype`` natively."""
    return np.dtype(dtype).name in _NCCL_TYPES


def nccl_type_and_op(dtype: np.dtype, op: ops.ReduceOp) -> tuple[str, str]:
    """The names of NCCL's datatype and reduction for ``dtype`` and ``op``."""
    name = np.dtype(dtype).name
    if name not in _NCCL_TYPES or op not in _NCCL_OPS:
        raise CollectiveError(f"NCCL cannot reduce dtype {name} with {op!r}")
    if name == "bool":
        op = _BOOL_OPS[op]
    return _NCCL_TYPES[name], _NCCL_OPS[op]


class NcclCommunicator(Communicator):
    """Collectives among one GPU per rank.

    Args:
        comm: cupy's ``NcclCommunicator``.
        rank, size: This rank and the number of ranks in ``comm``.
        device_id: The CUDA device of this rank.
    """

    name = "nccl"

    def __init__(self, comm: Any, rank: int, size: int, device_id: int) -> None:
        self.nccl_comm = comm
        self.rank, self.size = rank, size
        self.device_id = device_id
        self._nccl = library.nccl()
        self._cp = library.cupy()
        self.stream = streams.collective_stream(device_id)
        self.fusion = FusionBuffer(self._cp)
        self._closed = False

    @classmethod
    def form(cls, host: Communicator, device_id: int) -> NcclCommunicator:
        """Form an NCCL communicator among ``host``'s ranks (a collective over ``host``)."""
        nccl = library.nccl()
        unique = id_from_tuple(nccl.get_unique_id()) if host.rank == 0 else None
        unique = broadcast_unique_id(host, 0, unique)
        with library.cupy().cuda.Device(device_id):
            comm = nccl.NcclCommunicator(host.size, id_to_tuple(unique), host.rank)
        log.debug("NCCL communicator formed: rank %d of %d on device %d", host.rank,
                  host.size, device_id)
        return cls(comm, host.rank, host.size, device_id)

    def _const(self, name: str) -> int:
        return getattr(self._nccl, name)

    def _check(self, what: str) -> None:
        if self._closed:
            raise CollectiveError(f"NCCL {what}: the communicator of rank {self.rank} is closed")

    def allreduce(self, buf: SegmentedBuffer, op: ops.ReduceOp) -> None:
        self._check("allreduce")
        if buf.size == 0:
            return
        dtype, nccl_op = nccl_type_and_op(buf.dtype, ops.ReduceOp(op))
        with self._cp.cuda.Device(self.device_id), self.stream:
            flat = self.fusion.pack(buf.pieces)
            ptr = flat.data.ptr
            self.nccl_comm.allReduce(ptr, ptr, flat.size, self._const(dtype),
                                     self._const(nccl_op), self.stream.ptr)
            self.fusion.unpack(flat, buf.pieces)

    def reducescatter(self, buf: SegmentedBuffer, op: ops.ReduceOp, counts: Sequence[int]) -> None:
        self._check("reducescatter")
        if buf.size == 0:
            return
        if len(set(counts)) > 1:
            # NCCL scatters equal blocks only; the contract only promises our block.
            self.allreduce(buf, op)
            return
        dtype, nccl_op = nccl_type_and_op(buf.dtype, ops.ReduceOp(op))
        count = counts[0]
        with self._cp.cuda.Device(self.device_id), self.stream:
            flat = self.fusion.pack(buf.pieces)
            mine = self._cp.empty(count, flat.dtype)
            self.nccl_comm.reduceScatter(flat.data.ptr, mine.data.ptr, count,
                                         self._const(dtype), self._const(nccl_op),
                                         self.stream.ptr)
            start = self.rank * count
            flat[start : start + count] = mine
            self.fusion.unpack(flat, buf.pieces)

    def allgather(self, buf: SegmentedBuffer, counts: Sequence[int]) -> None:
        self._check("allgather")
        if buf.size == 0:
            return
        item = buf.itemsize
        byte = self._const("NCCL_UINT8")
        with self._cp.cuda.Device(self.device_id), self.stream:
            flat = self.fusion.pack(buf.pieces)
            raw = flat.view(self._cp.uint8)
            starts = offsets(counts)
            if len(set(counts)) == 1:
                n = counts[0] * item
                self.nccl_comm.allGather(raw[starts[self.rank] * item :].data.ptr,
                                         raw.data.ptr, n, byte, self.stream.ptr)
            else:  # unequal blocks: one broadcast per rank, launched as one group
                self._nccl.groupStart()
                try:
                    for root, (start, count) in enumerate(zip(starts, counts)):
                        if count:
                            ptr = raw[start * item :].data.ptr
                            self.nccl_comm.broadcast(ptr, ptr, count * item, byte, root,
                                                     self.stream.ptr)
                finally:
                    self._nccl.groupEnd()
            self.fusion.unpack(flat, buf.pieces)

    def broadcast(self, buf: SegmentedBuffer, root: int) -> None:
        self._check("broadcast")
        if buf.size == 0:
            return
        with self._cp.cuda.Device(self.device_id), self.stream:
            flat = self.fusion.pack(buf.pieces)
            ptr = flat.data.ptr
            self.nccl_comm.broadcast(ptr, ptr, flat.nbytes, self._const("NCCL_UINT8"), root,
                                     self.stream.ptr)
            if self.rank != root:
                self.fusion.unpack(flat, buf.pieces)

    def alltoall(self, send: Any, send_counts: Sequence[int], recv: Any,
                 recv_counts: Sequence[int]) -> None:
        self._check("alltoall")
        item = send.dtype.itemsize
        byte = self._const("NCCL_UINT8")
        s_off, r_off = offsets(send_counts), offsets(recv_counts)
        with self._cp.cuda.Device(self.device_id), self.stream:
            raw_send, raw_recv = send.view(self._cp.uint8), recv.view(self._cp.uint8)
            me = self.rank
            if send_counts[me]:
                lo, hi = s_off[me] * item, (s_off[me] + send_counts[me]) * item
                raw_recv[r_off[me] * item : r_off[me] * item + hi - lo] = raw_send[lo:hi]
            self._nccl.groupStart()
            try:
                for peer in range(self.size):
                    if peer == me:
                        continue
                    if send_counts[peer]:
                        self.nccl_comm.send(raw_send[s_off[peer] * item :].data.ptr,
                                            send_counts[peer] * item, byte, peer,
                                            self.stream.ptr)
                    if recv_counts[peer]:
                        self.nccl_comm.recv(raw_recv[r_off[peer] * item :].data.ptr,
                                            recv_counts[peer] * item, byte, peer,
                                            self.stream.ptr)
            finally:
                self._nccl.groupEnd()

    def check(self) -> None:
        """Raise NCCL's asynchronous error, if any (a peer failed mid-collective)."""
        try:
            self.nccl_comm.check_async_error()
        except Exception as exc:  # noqa: BLE001 - NCCL's error type is cupy's
            raise CollectiveError(f"NCCL on rank {self.rank} failed: {exc}") from exc

    def abort(self) -> None:
        """Abort NCCL's pending work (another thread saw the job break)."""
        if not self._closed:
            self._closed = True
            self.nccl_comm.abort()

    def close(self) -> None:
        """Destroy the communicator once its queued work is done; abort it when that work
        does not finish within the deadline (a peer died mid-collective: destroying would
        wait for it forever)."""
        if not self._closed:
            self._closed = True
            done = streams.done_event(self.device_id)
            deadline = time.monotonic() + _CLOSE_WAIT_S
            while not done.done and time.monotonic() < deadline:
                time.sleep(0.01)
            if done.done:
                self.nccl_comm.destroy()
            else:
                log.warning("rank %d: NCCL work still pending after %.0f s; aborting the NCCL "
                            "communicator", self.rank, _CLOSE_WAIT_S)
                self.nccl_comm.abort()
        self.fusion.release()
