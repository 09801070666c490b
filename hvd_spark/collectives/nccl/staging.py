"""Device buffers through host memory: the fallback when no device path serves them.

Used when the plan says ``host`` (no NCCL, HVD_SPARK_GPU_BACKEND=host), for dtypes NCCL
lacks, and for the collectives the hierarchical path does not cover. Each call copies
to the host (waiting for the GPU), runs the host backend, and copies back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.nccl.arrays import copy_into, is_device, to_host


class HostStagingCommunicator(Communicator):
    """Runs ``host``'s collectives on host copies of device buffers.

    Args:
        host: The host backend's communicator.
        owns_host: ``close`` closes ``host`` too (when nobody else owns it).
    """

    name = "host-staging"

    def __init__(self, host: Communicator, owns_host: bool = False) -> None:
        self.host = host
        self.rank, self.size = host.rank, host.size
        self._owns_host = owns_host

    @staticmethod
    def _stage(buf: SegmentedBuffer) -> tuple[SegmentedBuffer, list[Any]]:
        host_pieces = [to_host(p) if is_device(p) else p for p in buf.pieces]
        return SegmentedBuffer(host_pieces or [to_host(buf.pieces[0])]), host_pieces

    @staticmethod
    def _unstage(buf: SegmentedBuffer, host_pieces: list[Any]) -> None:
        for piece, host in zip(buf.pieces, host_pieces):
            if piece is not host:
                copy_into(piece, host)

    def allreduce(self, buf: SegmentedBuffer, op: ops.ReduceOp) -> None:
        if buf.size == 0:
            return
        staged, pieces = self._stage(buf)
        self.host.allreduce(staged, op)
        self._unstage(buf, pieces)

    def reducescatter(self, buf: SegmentedBuffer, op: ops.ReduceOp, counts: Sequence[int]) -> None:
        if buf.size == 0:
            return
        staged, pieces = self._stage(buf)
        self.host.reducescatter(staged, op, counts)
        self._unstage(buf, pieces)

    def allgather(self, buf: SegmentedBuffer, counts: Sequence[int]) -> None:
        if buf.size == 0:
            return
        staged, pieces = self._stage(buf)
        self.host.allgather(staged, counts)
        self._unstage(buf, pieces)

    def broadcast(self, buf: SegmentedBuffer, root: int) -> None:
        if buf.size == 0:
            return
        staged, pieces = self._stage(buf)
        self.host.broadcast(staged, root)
        self._unstage(buf, pieces)

    def alltoall(self, send: Any, send_counts: Sequence[int], recv: Any,
                 recv_counts: Sequence[int]) -> None:
        host_send = to_host(send) if is_device(send) else send
        host_recv = to_host(recv) if is_device(recv) else recv
        self.host.alltoall(host_send, send_counts, host_recv, recv_counts)
        if host_recv is not recv:
            copy_into(recv, host_recv)

    def abort(self) -> None:
        self.host.abort()

    def close(self) -> None:
        """Close the host communicator if we own it (else its owner does)."""
        if self._owns_host:
            self.host.close()
