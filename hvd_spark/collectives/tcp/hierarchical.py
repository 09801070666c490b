"""Hierarchical all-reduce for several ranks per host (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE).

With L ranks on each of H hosts (ranks consecutive per host, as the launchers assign
them), an all-reduce runs in three phases over the flat communicator's own links:

1. reduce-scatter within the host (shared memory): local rank l holds slice l of the
   host's sum;
2. all-reduce of slice l across the hosts, on a ring of the H ranks with local rank l:
   L such rings run at once, each carrying 1/L of the data;
3. all-gather within the host: every rank gets every slice.

Each host then sends and receives 2(H-1)/H of the buffer over the network, where the
flat ring of L*H ranks sends 2(LH-1)/(LH); and it takes 2(L-1)+2(H-1) ring steps
instead of 2(LH-1). Everything else (other collectives, process sets) stays flat.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer, even_counts
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.tcp.communicator import TcpCommunicator

log = logging.getLogger(__name__)

# Operations whose three-phase result equals the flat ring's (element-wise and associative).
_ELEMENTWISE = {ops.ReduceOp.Sum, ops.ReduceOp.Average, ops.ReduceOp.Min, ops.ReduceOp.Max,
                ops.ReduceOp.Product}


def host_grid(flat: TcpCommunicator, local_rank: int, local_size: int, cross_rank: int,
              cross_size: int) -> tuple[int, int] | None:
    """``(L, H)`` when every rank agrees the job is H hosts of L consecutive ranks, else None.

    Collective: every rank of ``flat`` must call it (one small all-gather), so all of
    them take the same decision.
    """
    mine = np.array([flat.rank, local_rank, local_size, cross_rank, cross_size], np.int64)
    everyone = np.zeros(5 * flat.size, np.int64)
    everyone[5 * flat.rank: 5 * flat.rank + 5] = mine
    flat.allgather(SegmentedBuffer([everyone]), [5] * flat.size)
    rows = everyone.reshape(flat.size, 5)
    local, cross = int(rows[0, 2]), int(rows[0, 4])
    if local < 2 or cross < 2 or local * cross != flat.size:
        return None
    for r, lr, ls, cr, cs in rows.tolist():
        if ls != local or cs != cross or r != cr * local + lr:
            return None
    return local, cross


class HierarchicalCommunicator(Communicator):
    """All-reduce in three phases (see the module doc); the rest from ``flat``.

    Args:
        flat: The job's ring communicator (its links are shared, not copied).
        local_size, cross_size: L ranks per host, H hosts (from ``host_grid``).
    """

    name = "tcp"

    def __init__(self, flat: TcpCommunicator, local_size: int, cross_size: int) -> None:
        self.flat = flat
        self.rank, self.size = flat.rank, flat.size
        self.local_size, self.cross_size = local_size, cross_size
        host, self.local_rank = divmod(flat.rank, local_size)
        self.local = flat.subset([host * local_size + k for k in range(local_size)])
        self.cross = flat.subset([h * local_size + self.local_rank for h in range(cross_size)])

    def allreduce(self, buf: SegmentedBuffer, op: ops.ReduceOp) -> None:
        if op not in _ELEMENTWISE or buf.size < self.local_size:
            self.flat.allreduce(buf, op)
            return
        counts = even_counts(buf.size, self.local_size)
        self.local.reducescatter(buf, op, counts)
        start = sum(counts[: self.local_rank])
        mine = buf.views(start, start + counts[self.local_rank])
        self.cross.allreduce(SegmentedBuffer(mine), op)
        self.local.allgather(buf, counts)

    def reducescatter(self, buf: SegmentedBuffer, op: ops.ReduceOp, counts: Sequence[int]) -> None:
        self.flat.reducescatter(buf, op, counts)

    def allgather(self, buf: SegmentedBuffer, counts: Sequence[int]) -> None:
        self.flat.allgather(buf, counts)

    def broadcast(self, buf: SegmentedBuffer, root: int) -> None:
        self.flat.broadcast(buf, root)

    def alltoall(self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                 recv_counts: Sequence[int]) -> None:
        self.flat.alltoall(send, send_counts, recv, recv_counts)

    def subset(self, members: Sequence[int]) -> Communicator:
        return self.flat.subset(members)

    def abort(self) -> None:
        self.flat.abort()

    def close(self) -> None:
        self.flat.close()

    @property
    def links(self):  # noqa: ANN201 - the flat communicator's, for inspection and tests
        return self.flat.links

    @property
    def shm_peers(self) -> list[int]:
        return self.flat.shm_peers


def maybe_hierarchical(flat: TcpCommunicator, world, enabled: bool | None) -> Communicator:
    """``flat``, or a HierarchicalCommunicator over it where the hosts allow and it is on.

    Args:
        flat: The job's ring.
        world: The rank's WorldInfo (local/cross ranks and sizes).
        enabled: True/False as the user set it; None: the default (on where it applies).
    """
    if enabled is False or flat.size < 4:
        return flat
    grid = host_grid(flat, world.local_rank, world.local_size, world.cross_rank,
                     world.cross_size)
    if grid is None:
        if enabled:
            log.info("hierarchical allreduce needs the same number of ranks on every host, "
                     "consecutive per host; using the flat ring")
        return flat
    return HierarchicalCommunicator(flat, *grid)
