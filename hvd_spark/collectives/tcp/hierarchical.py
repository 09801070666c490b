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
instead of 2(LH-1). Large buffers flow through the phases in blocks, so the shared-memory
phases of one block overlap the network phase of another. Everything else (other
collectives, process sets) stays flat.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer, even_counts
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.tcp.communicator import TcpCommunicator
from hvd_spark.collectives.tcp.links import TcpLink
from hvd_spark.collectives.tcp.shm import negotiate_shm
from hvd_spark.errors import CollectiveTimeoutError

log = logging.getLogger(__name__)

# Buffers larger than this go through the phases block by block, overlapped (see
# ``_pipelined``); smaller ones in one pass.
PIPELINE_BLOCK_BYTES = 4 << 20
_FALLBACK_TIMEOUT_S = 300.0

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
    finishes_segments = True
    tunes_chunks = True  # the flat ring's chunk, which the host and cross rings share

    def __init__(self, flat: TcpCommunicator, local_size: int, cross_size: int) -> None:
        self.flat = flat
        self.rank, self.size = flat.rank, flat.size
        self.local_size, self.cross_size = local_size, cross_size
        host, self.local_rank = divmod(flat.rank, local_size)
        self.local = flat.subset([host * local_size + k for k in range(local_size)])
        self.cross = flat.subset([h * local_size + self.local_rank for h in range(cross_size)])

    def allreduce(self, buf: SegmentedBuffer, op: ops.ReduceOp,
                  finish: Callable[[list[np.ndarray]], None] | None = None) -> None:
        """In place; ``finish`` runs once per element, in the cross-host ring that
        completes it (see ``Communicator.allreduce``)."""
        if op not in _ELEMENTWISE or buf.size < self.local_size:
            self.flat.allreduce(buf, op, finish=finish)
            return
        step = max(self.local_size, PIPELINE_BLOCK_BYTES // buf.itemsize)
        blocks = [SegmentedBuffer(buf.views(lo, min(buf.size, lo + step)))
                  for lo in range(0, buf.size, step)]
        if len(blocks) == 1:
            self._reduce_scatter(blocks[0], op)
            self.cross.allreduce(self._my_slice(blocks[0]), op, finish=finish)
            self.local.allgather(blocks[0], even_counts(blocks[0].size, self.local_size))
        else:
            self._pipelined(blocks, op, finish)

    def _reduce_scatter(self, block: SegmentedBuffer, op: ops.ReduceOp) -> None:
        self.local.reducescatter(block, op, even_counts(block.size, self.local_size))

    def _my_slice(self, block: SegmentedBuffer) -> SegmentedBuffer:
        counts = even_counts(block.size, self.local_size)
        start = sum(counts[: self.local_rank])
        return SegmentedBuffer(block.views(start, start + counts[self.local_rank]))

    def _pipelined(self, blocks: list[SegmentedBuffer], op: ops.ReduceOp,
                   finish: Callable[[list[np.ndarray]], None] | None = None) -> None:
        """Blocks flow through the phases: while the network reduces block k, this thread
        reduce-scatters block k+1 and all-gathers block k-1 over shared memory.

        Each link is used by one thread only (the local ring here, the cross ring in
        the helper) in an order fixed by the block numbers, the same on every rank.
        """
        ready: queue.SimpleQueue = queue.SimpleQueue()  # block numbers; None: stop
        done: queue.SimpleQueue = queue.SimpleQueue()  # (block, error or None)

        def cross_loop() -> None:
            while (k := ready.get()) is not None:
                try:
                    self.cross.allreduce(self._my_slice(blocks[k]), op, finish=finish)
                except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
                    done.put((k, exc))
                    return
                done.put((k, None))

        helper = threading.Thread(target=cross_loop, name="hvd-hier-cross", daemon=True)
        helper.start()
        try:
            for k in range(len(blocks) + 1):
                if k < len(blocks):
                    self._reduce_scatter(blocks[k], op)
                    ready.put(k)
                if k > 0:
                    self._wait(done, k - 1)
                    self.local.allgather(blocks[k - 1],
                                         even_counts(blocks[k - 1].size, self.local_size))
        finally:
            ready.put(None)
            helper.join(self._deadline_s())

    def _wait(self, done: queue.SimpleQueue, k: int) -> None:
        try:
            got, error = done.get(timeout=self._deadline_s())
        except queue.Empty:
            raise CollectiveTimeoutError(
                f"the cross-host all-reduce of block {k} did not finish within "
                f"{self._deadline_s():.0f} s") from None
        if error is not None:
            raise error
        assert got == k

    def _deadline_s(self) -> float:
        # Every wait of the helper is bounded by its sockets' timeout (the collective
        # timeout); this bound only matters if the helper itself is stuck.
        timeouts = [link.sock.gettimeout() for link in self.cross.links.values()]
        return max([t for t in timeouts if t] or [_FALLBACK_TIMEOUT_S]) + 5.0

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

    def set_chunk_bytes(self, chunk_bytes: int) -> None:
        """The flat ring's (its host and cross views share it)."""
        self.flat.set_chunk_bytes(chunk_bytes)

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


def share_memory_on_wrap(flat: TcpCommunicator, local_size: int, shm_tag: str) -> None:
    """Give the host ring's closing link (local rank L-1 to 0) shared memory, as its other
    links have (they are neighbours on the flat ring too). Collective on each such pair;
    a rank is in at most one, so no order is needed. Both sides keep TCP if either cannot."""
    host, local = divmod(flat.rank, local_size)
    if local_size < 3 or local not in (0, local_size - 1):
        return
    peer = host * local_size + (local_size - 1 if local == 0 else 0)
    link = flat.links[peer]
    if not isinstance(link, TcpLink):
        return
    shm = negotiate_shm(link.sock, peer, flat.slot_bytes, tag=shm_tag, spin_s=flat.spin_s)
    if shm is not None:
        flat.links[peer] = shm
        flat.shm_peers = sorted({*flat.shm_peers, peer})


def maybe_hierarchical(flat: TcpCommunicator, world, enabled: bool | None,
                       use_shm: bool = True, shm_tag: str = "job") -> Communicator:
    """``flat``, or a HierarchicalCommunicator over it where the hosts allow and it is on.

    Args:
        flat: The job's ring.
        world: The rank's WorldInfo (local/cross ranks and sizes).
        enabled: True/False as the user set it; None: the default (on where it applies).
        use_shm, shm_tag: As for the flat ring (shared memory on the host ring's links).
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
    if use_shm:
        share_memory_on_wrap(flat, grid[0], shm_tag)
    return HierarchicalCommunicator(flat, *grid)
