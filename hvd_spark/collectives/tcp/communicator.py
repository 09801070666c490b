"""The default CPU backend: ring collectives over TCP, shared memory on one host (and the
host arena for allreduces of 3+ ranks there)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence

import numpy as np

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.tcp import ring
from hvd_spark.collectives.tcp.arena import HostArena, negotiate_arena
from hvd_spark.collectives.tcp.express_lane import ExpressLane, lane_supported, negotiate_lane
from hvd_spark.collectives.tcp.links import Link, TcpLink
from hvd_spark.collectives.tcp.shm import negotiate_shm
from hvd_spark.errors import CollectiveError

log = logging.getLogger(__name__)


class _RingSettings:
    """What a communicator and its process-set views share: the chunk size they cut
    buffers by, which the engine may change between operations (autotune)."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes


class TcpCommunicator(Communicator):
    """Ring collectives over per-peer links.

    Args:
        rank, size: This rank and the world size.
        data_socks: Peer rank -> authenticated data socket, for every other rank.
        chunk_bytes: Pipelining chunk size (``set_chunk_bytes`` changes it later).
        use_shm: Try shared memory with the ring neighbours.
        shm_tag: Names the job's shared-memory files (``job_tag``).
        slot_bytes: Shared-memory slot size (default ``chunk_bytes``): the largest chunk
            the communicator can ever use, since slots are sized once.
        spin_s: Seconds a shared-memory link polls for its peer's notice before blocking
            (``EngineConfig.spin_seconds``).
        express_lane_bytes: With two ranks sharing memory, also set up the express lane
            with buffers of this size (0: none; see ``express_lane``).
        arena_bytes: With 3+ ranks, all on this host, also map the host arena with pieces of
            this size (0: none; see ``arena``); allreduces then go through it.
    """

    name = "tcp"
    reads_source = True
    finishes_segments = True
    tunes_chunks = True

    def __init__(
        self,
        rank: int,
        size: int,
        data_socks: dict[int, socket.socket],
        chunk_bytes: int,
        use_shm: bool = True,
        shm_tag: str = "job",
        slot_bytes: int | None = None,
        spin_s: float = 0.0,
        express_lane_bytes: int = 0,
        arena_bytes: int = 0,
    ) -> None:
        self.rank, self.size = rank, size
        self._owns_links = True  # a process set's view shares them (see subset)
        self.slot_bytes = max(chunk_bytes, slot_bytes or 0)
        self.spin_s = spin_s
        self._ring = _RingSettings(chunk_bytes)
        self.links: dict[int, Link] = {}
        self.left_rank = (rank - 1) % size
        self.right_rank = (rank + 1) % size
        neighbours = {self.left_rank, self.right_rank} - {rank}
        # Negotiate in ascending peer order on both sides of every pair: no deadlock.
        for peer in sorted(data_socks):
            sock = data_socks[peer]
            shm = use_shm and peer in neighbours
            link = (negotiate_shm(sock, peer, self.slot_bytes, tag=shm_tag, spin_s=spin_s)
                    if shm else None)
            self.links[peer] = link if link is not None else TcpLink(sock, peer)
        self.shm_peers = sorted(p for p, ln in self.links.items() if not isinstance(ln, TcpLink))
        #: Two ranks sharing memory: the express lane between them (the engine's), or None.
        self.express_lane: ExpressLane | None = None
        if size == 2 and self.shm_peers and lane_supported():
            # Both ranks reach this (same size, same shm outcome, same CPU), whatever
            # their lane setting: negotiate_lane agrees on none when one is off.
            peer = self.shm_peers[0]
            self.express_lane = negotiate_lane(data_socks[peer], peer, express_lane_bytes,
                                               tag=shm_tag)
        #: Three or more ranks, all on this host: the arena allreduces go through, or None.
        #: (Two ranks keep the ring: two steps, which wait in the kernel, against two
        #: meetings that nap; the arena lost to it at 16-64 MB with 2 ranks here.)
        self.arena: HostArena | None = None
        if size > 2:
            # Every rank negotiates, whatever its settings, and all get the same answer.
            self.arena = negotiate_arena(rank, size, data_socks, arena_bytes, shm_tag, spin_s,
                                         offer=use_shm and lane_supported())
        # With one rank there are no neighbours; every algorithm returns before using them.
        self.left = self.links.get(self.left_rank)
        self.right = self.links.get(self.right_rank)

    def subset(self, members: Sequence[int]) -> TcpCommunicator:
        """A ring among ``members`` over this communicator's links (no new connections)."""
        sub = TcpCommunicator.__new__(TcpCommunicator)
        sub.rank, sub.size = list(members).index(self.rank), len(members)
        sub.slot_bytes, sub._ring = self.slot_bytes, self._ring  # one chunk size for all views
        sub.spin_s = self.spin_s
        sub.links = {i: self.links[g] for i, g in enumerate(members) if g != self.rank}
        sub.left_rank = (sub.rank - 1) % sub.size
        sub.right_rank = (sub.rank + 1) % sub.size
        sub.shm_peers = [i for i, g in enumerate(members) if g in self.shm_peers]
        sub.left = sub.links.get(sub.left_rank)
        sub.right = sub.links.get(sub.right_rank)
        sub._owns_links = False
        sub.express_lane = None  # the world's engine's alone
        sub.arena = None  # its pieces are counted by the world's allreduces
        return sub

    @property
    def chunk_bytes(self) -> int:
        """Bytes per pipelined chunk (the same on every rank: chunks are cut identically)."""
        return self._ring.chunk_bytes

    def set_chunk_bytes(self, chunk_bytes: int) -> None:
        """Cut buffers into chunks of ``chunk_bytes`` from the next operation on.

        Every rank must switch at the same point of the operation order (the engine
        does it at the response that carries the new size); process-set views follow.

        Raises:
            CollectiveError: The chunk would not fit a shared-memory slot.
        """
        if chunk_bytes < 4096 or (self.shm_peers and chunk_bytes > self.slot_bytes):
            raise CollectiveError(
                f"ring chunk of {chunk_bytes} bytes on rank {self.rank}: it must be at least "
                f"4096 and fit the {self.slot_bytes}-byte shared-memory slots")
        self._ring.chunk_bytes = chunk_bytes

    def allreduce(self, buf: SegmentedBuffer, op: ops.ReduceOp,
                  source: SegmentedBuffer | None = None,
                  finish: Callable[[list[np.ndarray]], None] | None = None) -> None:
        if self.arena is not None:
            self.arena.allreduce(buf, op, source, finish)
            return
        ring.allreduce(buf, op, self.rank, self.size, self.left, self.right, self.chunk_bytes,
                       source, finish)

    def reducescatter(self, buf: SegmentedBuffer, op: ops.ReduceOp, counts: Sequence[int]) -> None:
        if self.size > 1:
            ring.reduce_scatter(
                buf, op, self.rank, self.size, self.left, self.right, self.chunk_bytes, counts
            )

    def allgather(self, buf: SegmentedBuffer, counts: Sequence[int]) -> None:
        if self.size > 1:
            segs = ring.segments_of(counts)
            ring.all_gather_segments(
                buf, segs, self.rank, self.size, self.left, self.right, self.chunk_bytes
            )

    def broadcast(self, buf: SegmentedBuffer, root: int) -> None:
        if self.size > 1:
            ring.broadcast(buf, root, self.rank, self.size, self.left, self.right, self.chunk_bytes)

    def alltoall(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        recv: np.ndarray,
        recv_counts: Sequence[int],
    ) -> None:
        ring.alltoall(
            send, send_counts, recv, recv_counts, self.rank, self.size, self.links, self.chunk_bytes
        )

    def abort(self) -> None:
        # shutdown() (unlike close) is safe while the engine thread uses the sockets,
        # and wakes a recv blocked on them, over TCP and shared memory alike.
        for link in self.links.values():
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        if not self._owns_links:
            return  # a process set's view: the world communicator closes the links
        for link in self.links.values():
            try:
                link.close()
            except OSError:
                pass
        if self.express_lane is not None:
            self.express_lane.close()
        if self.arena is not None:
            self.arena.close()
