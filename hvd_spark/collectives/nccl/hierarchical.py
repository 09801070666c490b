"""Several ranks per GPU and several GPUs: CUDA IPC inside each GPU, NCCL between GPUs.

Allreduce: the ranks of each GPU combine through IPC, the GPUs' leaders (lowest rank
of each) allreduce that through NCCL, and each leader hands the result to its GPU's
ranks through IPC. Broadcast goes root -> its leader -> the other leaders -> their
ranks. The other collectives stage through the host (rarely hot in training).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.nccl.communicator import NcclCommunicator
from hvd_spark.collectives.nccl.ipc import IpcCommunicator
from hvd_spark.collectives.nccl.staging import HostStagingCommunicator


class HierarchicalDeviceCommunicator(Communicator):
    """IPC within a GPU's ranks, NCCL among the GPUs' leaders.

    Args:
        host: Host communicator of all ranks (staged collectives).
        ipc: This GPU's ranks.
        leaders_nccl: NCCL among the leaders (None on ranks that do not lead).
        groups: Every GPU's ranks, as ranks of ``host``, each ascending; ordered by leader.
    """

    name = "ipc+nccl"

    def __init__(self, host: Communicator, ipc: IpcCommunicator,
                 leaders_nccl: NcclCommunicator | None,
                 groups: Sequence[Sequence[int]]) -> None:
        self.rank, self.size = host.rank, host.size
        self.ipc = ipc
        self.nccl = leaders_nccl
        self.groups = [list(g) for g in groups]
        self.staging = HostStagingCommunicator(host)

    def _group_of(self, rank: int) -> int:
        return next(i for i, g in enumerate(self.groups) if rank in g)

    def allreduce(self, buf: SegmentedBuffer, op: ops.ReduceOp) -> None:
        self.ipc.allreduce(buf, op)  # every rank of the GPU holds the GPU's combination
        if self.nccl is not None:
            self.nccl.allreduce(buf, op)
            self.nccl.stream.synchronize()  # the leader's IPC broadcast reads it next
        self.ipc.broadcast(buf, 0)

    def broadcast(self, buf: SegmentedBuffer, root: int) -> None:
        root_group = self._group_of(root)
        mine = self._group_of(self.rank)
        if mine == root_group:
            self.ipc.broadcast(buf, self.groups[mine].index(root))
        if self.nccl is not None:
            self.nccl.broadcast(buf, root_group)
            self.nccl.stream.synchronize()
        if mine != root_group:
            self.ipc.broadcast(buf, 0)

    def reducescatter(self, buf: SegmentedBuffer, op: ops.ReduceOp, counts: Sequence[int]) -> None:
        self.allreduce(buf, op)  # every block reduced; the contract needs only ours

    def allgather(self, buf: SegmentedBuffer, counts: Sequence[int]) -> None:
        self.staging.allgather(buf, counts)

    def alltoall(self, send: Any, send_counts: Sequence[int], recv: Any,
                 recv_counts: Sequence[int]) -> None:
        self.staging.alltoall(send, send_counts, recv, recv_counts)

    def abort(self) -> None:
        if self.nccl is not None:
            self.nccl.abort()

    def close(self) -> None:
        try:
            if self.nccl is not None:
                self.nccl.close()
        finally:
            self.ipc.close()
