"""Ranks sharing one GPU: they exchange through CUDA IPC and reduce on the device.

NCCL refuses two ranks on one device, which Spark's fractional GPU amounts produce.
Each rank of such a group owns an exchange buffer (a plain ``cudaMalloc``: IPC handles
name whole allocations) that the others map with ``cudaIpcOpenMemHandle``. A
collective writes the inputs there, meets the group at a host barrier, and every rank
combines the buffers in rank order with the same kernels, so the results are bitwise
equal on every rank. The host barriers (over the host communicator) are what keeps
one operation's reads from racing the next one's writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer, offsets
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.nccl import library, streams
from hvd_spark.collectives.nccl.exchange import allgather_bytes
from hvd_spark.collectives.nccl.fusion import FusionBuffer

_UFUNCS = {ops.Sum: "add", ops.Average: "add", ops.Min: "minimum", ops.Max: "maximum",
           ops.Product: "multiply"}
_BOOL_UFUNCS = {ops.Sum: "logical_or", ops.Max: "logical_or", ops.Min: "logical_and",
                ops.Product: "logical_and"}


def combine_in_rank_order(xp: Any, parts: Sequence[Any], op: ops.ReduceOp, out: Any) -> None:
    """``out = parts[0] op parts[1] op ...``, left to right (the same on every rank)."""
    table = _BOOL_UFUNCS if parts[0].dtype == np.bool_ else _UFUNCS
    ufunc = getattr(xp, table[ops.ReduceOp(op)])
    out[...] = parts[0]
    for part in parts[1:]:
        ufunc(out, part, out=out)


class IpcCommunicator(Communicator):
    """Collectives among the ranks of one GPU, through CUDA IPC.

    Args:
        host: Host communicator among exactly these ranks (barriers, handle exchange).
        device_id: The shared CUDA device.
    """

    name = "cuda-ipc"

    def __init__(self, host: Communicator, device_id: int) -> None:
        self.host = host
        self.rank, self.size = host.rank, host.size
        self.device_id = device_id
        self._cp = library.cupy()
        self.stream = streams.collective_stream(device_id)
        self.fusion = FusionBuffer(self._cp)
        self._capacity = 0
        self._mine: int | None = None  # our cudaMalloc'd exchange buffer
        self._ptrs: list[int] = []  # every rank's buffer, mapped into this process
        self._closed = False

    # ------------------------------------------------------------------ plumbing

    def _barrier(self) -> None:
        self.host.allreduce(SegmentedBuffer([np.zeros(1, np.uint8)]), ops.Max)

    def _agree(self, nbytes: int) -> int:
        """The largest ``nbytes`` any rank needs (sizes can differ in alltoall)."""
        need = np.array([nbytes], np.int64)
        self.host.allreduce(SegmentedBuffer([need]), ops.Max)
        return int(need[0])

    def _ensure(self, nbytes: int) -> None:
        """Grow every rank's exchange buffer to ``nbytes`` (all ranks pass the same)."""
        if nbytes <= self._capacity:
            return
        runtime = self._cp.cuda.runtime
        self._release()
        capacity = 1 << max(20, (nbytes - 1).bit_length())
        with self._cp.cuda.Device(self.device_id):
            self._mine = runtime.malloc(capacity)
            handle = bytes(runtime.ipcGetMemHandle(self._mine))
        handles = allgather_bytes(self.host, handle)
        self._ptrs = []
        with self._cp.cuda.Device(self.device_id):
            for r, peer_handle in enumerate(handles):
                # The default flag (lazy peer access) is what mapping on one device needs.
                self._ptrs.append(self._mine if r == self.rank
                                  else runtime.ipcOpenMemHandle(peer_handle))
        self._capacity = capacity

    def _release(self) -> None:
        runtime = self._cp.cuda.runtime
        with self._cp.cuda.Device(self.device_id):
            for r, ptr in enumerate(self._ptrs):
                if r != self.rank:
                    runtime.ipcCloseMemHandle(ptr)
            if self._mine is not None:
                runtime.free(self._mine)
        self._ptrs, self._mine, self._capacity = [], None, 0

    def _view(self, rank: int, dtype: Any, count: int, offset: int = 0) -> Any:
        """Rank ``rank``'s exchange buffer as ``count`` elements of ``dtype``."""
        cp = self._cp
        memory = cp.cuda.UnownedMemory(self._ptrs[rank], self._capacity, None, self.device_id)
        pointer = cp.cuda.MemoryPointer(memory, offset * np.dtype(dtype).itemsize)
        return cp.ndarray((count,), dtype, pointer)

    def _publish(self) -> None:
        """Our writes are complete on the GPU; then every rank may read them."""
        self.stream.synchronize()
        self._barrier()

    def _done_reading(self) -> None:
        """Our reads of the others' buffers are complete; then they may be reused."""
        self.stream.synchronize()
        self._barrier()

    # ------------------------------------------------------------------ the contract

    def allreduce(self, buf: SegmentedBuffer, op: ops.ReduceOp) -> None:
        if buf.size == 0 or self.size == 1:
            return
        self._ensure(buf.nbytes)
        with self._cp.cuda.Device(self.device_id), self.stream:
            flat = self.fusion.pack(buf.pieces)
            self._view(self.rank, flat.dtype, flat.size)[...] = flat
            self._publish()
            parts = [self._view(r, flat.dtype, flat.size) for r in range(self.size)]
            combine_in_rank_order(self._cp, parts, op, flat)
            self.fusion.unpack(flat, buf.pieces)
            self._done_reading()

    def reducescatter(self, buf: SegmentedBuffer, op: ops.ReduceOp, counts: Sequence[int]) -> None:
        self.allreduce(buf, op)  # every block reduced; the contract needs only ours

    def allgather(self, buf: SegmentedBuffer, counts: Sequence[int]) -> None:
        if buf.size == 0 or self.size == 1:
            return
        self._ensure(buf.nbytes)
        starts = offsets(counts)
        with self._cp.cuda.Device(self.device_id), self.stream:
            flat = self.fusion.pack(buf.pieces)
            lo, n = starts[self.rank], counts[self.rank]
            self._view(self.rank, flat.dtype, n, lo)[...] = flat[lo : lo + n]
            self._publish()
            for r in range(self.size):
                if r != self.rank and counts[r]:
                    flat[starts[r] : starts[r] + counts[r]] = self._view(r, flat.dtype, counts[r],
                                                                         starts[r])
            self.fusion.unpack(flat, buf.pieces)
            self._done_reading()

    def broadcast(self, buf: SegmentedBuffer, root: int) -> None:
        if buf.size == 0 or self.size == 1:
            return
        self._ensure(buf.nbytes)
        with self._cp.cuda.Device(self.device_id), self.stream:
            flat = self.fusion.pack(buf.pieces)
            if self.rank == root:
                self._view(root, flat.dtype, flat.size)[...] = flat
            self._publish()
            if self.rank != root:
                flat[...] = self._view(root, flat.dtype, flat.size)
                self.fusion.unpack(flat, buf.pieces)
            self._done_reading()

    def alltoall(self, send: Any, send_counts: Sequence[int], recv: Any,
                 recv_counts: Sequence[int]) -> None:
        self._ensure(self._agree(int(send.nbytes)))
        # Where each rank's block for us starts in its buffer: its own send offsets.
        raw = allgather_bytes(self.host, np.asarray(offsets(send_counts), np.int64).tobytes())
        their_offsets = [np.frombuffer(b, np.int64) for b in raw]
        with self._cp.cuda.Device(self.device_id), self.stream:
            if send.size:
                self._view(self.rank, send.dtype, send.size)[...] = send
            self._publish()
            r_off = offsets(recv_counts)
            for src in range(self.size):
                n = recv_counts[src]
                if n:
                    start = int(their_offsets[src][self.rank])
                    recv[r_off[src] : r_off[src] + n] = self._view(src, send.dtype, n, start)
            self._done_reading()

    def abort(self) -> None:
        self.host.abort()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._release()
        finally:
            self.fusion.release()
