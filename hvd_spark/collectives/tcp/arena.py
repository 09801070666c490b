"""The host arena: an allreduce through shared memory that every rank of a one-host job
maps, in two meetings a piece whatever the number of ranks.

Why: the ring passes a segment on one neighbour at a time, 2(N-1) steps a chunk, each
with a notice over a socket. Where the ranks outnumber the CPUs, every notice wakes a
sleeping process (tens of microseconds on a VM), and 3-4 ranks on one host ran at a
third of Open MPI. In the arena each rank copies its input into its own segment, all
meet, each reduces its 1/N of the piece reading every rank's segment (an element is
reduced once, on one rank), all meet again, and each copies the N reduced parts out.

A rank's segment holds the token ``shm.create_segment`` writes and the rank's meeting
count (offset 64) in its first page, then two areas of ``capacity`` bytes. Piece k of
the job's arena allreduces uses area k % 2 on every rank: a rank writes that area again
at piece k + 2 only after the first meeting of piece k + 1, which no rank reaches before
it has copied piece k's parts out; and during a piece a rank writes only its own part of
its own area, which no other rank reads before the second meeting.

Memory order: as on the express lane (x86-64 only, see ``express_lane``), a rank stores
the bytes before the count that announces them, and reads them after seeing the count;
there, stores pass no stores and loads pass no loads.

Waiting: a rank bumps its count and waits until every other count has reached it. It
looks (yielding the CPU between looks) for ``spin_s`` when a caller waits for the
result, or briefly otherwise (a background thread must leave the CPU to the caller's
compute), then naps in growing steps up to ``_MAX_NAP_S``, looking at the late ranks'
sockets now and then: a closed one means that rank died or the job is aborting. It
gives up at the sockets' timeout, the collective timeout the ring keeps too.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import time
from collections.abc import Callable

import numpy as np

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import SegmentedBuffer, even_counts, offsets
from hvd_spark.collectives.communicator import may_poll
from hvd_spark.collectives.tcp import readiness, wire
from hvd_spark.collectives.tcp.shm import create_segment, open_segment, unlink_quietly, unmap
from hvd_spark.errors import CollectiveTimeoutError, HvdSparkError, PeerDisconnectedError

log = logging.getLogger(__name__)

_COUNT_OFFSET = 64  # after the token
_DATA_OFFSET = 4096
_AREAS = 2
# A background thread's look before napping, and the naps: the first is about what a
# sleep costs anyway (timer slack); the longest bounds how late a rank notices.
_BRIEF_SPIN_S = 50e-6
_FIRST_NAP_S = 20e-6
_MAX_NAP_S = 200e-6
# How often a napping rank looks at the late ranks' sockets.
_SOCKET_CHECK_S = 5e-3
# Sockets without a timeout (none in jobs: the mesh sets one): still a deadline.
_DEFAULT_TIMEOUT_S = 600.0
_yield = getattr(os, "sched_yield", lambda: None)


class HostArena:
    """Every rank's segment, mapped in this rank.

    Args:
        rank, size: This rank and the world size.
        maps: Each rank's segment, indexed by rank (this rank's own included).
        capacity: Bytes per area (a piece of an allreduce).
        socks: Peer rank -> its data socket (watched while waiting, never read).
        spin_s: Seconds a waiting caller's meeting looks before napping.
    """

    def __init__(self, rank: int, size: int, maps: list[mmap.mmap], capacity: int,
                 socks: dict[int, socket.socket], spin_s: float = 0.0) -> None:
        self.rank, self.size = rank, size
        self.capacity = capacity
        self.spin_s = spin_s
        self._maps = maps
        self._socks = socks
        self._areas = [[np.frombuffer(m, np.uint8, capacity, _DATA_OFFSET + a * capacity)
                        for a in range(_AREAS)] for m in maps]
        # Aligned 8-byte counts: a reader sees the old value or the new, never a torn one.
        self._counts = [np.frombuffer(m, np.uint64, 1, _COUNT_OFFSET) for m in maps]
        self._meetings = 0
        self._pieces = 0

    def allreduce(self, buf: SegmentedBuffer, op: ops.ReduceOp,
                  source: SegmentedBuffer | None = None,
                  finish: Callable[[list[np.ndarray]], None] | None = None) -> None:
        """``Communicator.allreduce``: in place, or from ``source``; ``finish`` runs on the
        part this rank reduces, before the others copy it.

        Raises:
            PeerDisconnectedError: A late rank's socket closed (it died, or the job aborts).
            CollectiveTimeoutError: A rank did not arrive within the collective timeout.
        """
        per_piece = self.capacity // buf.itemsize
        inputs = buf if source is None else source
        for lo in range(0, buf.size, per_piece):
            self._piece(buf, inputs, lo, min(buf.size, lo + per_piece), op, finish)

    def _piece(self, buf: SegmentedBuffer, inputs: SegmentedBuffer, lo: int, hi: int,
               op: ops.ReduceOp, finish: Callable[[list[np.ndarray]], None] | None) -> None:
        """Elements ``[lo, hi)``: copy in, meet, reduce this rank's part, meet, copy out."""
        area = self._pieces % _AREAS
        self._pieces += 1
        nbytes = (hi - lo) * buf.itemsize
        parts = [areas[area][:nbytes].view(buf.dtype) for areas in self._areas]
        mine = parts[self.rank]
        pos = 0
        for view in inputs.views(lo, hi):
            np.copyto(mine[pos:pos + view.size], view)
            pos += view.size
        self._meet()
        counts = even_counts(hi - lo, self.size)
        starts = offsets(counts)
        start, stop = starts[self.rank], starts[self.rank] + counts[self.rank]
        if stop > start:
            own = mine[start:stop]
            for peer in range(self.size):
                if peer != self.rank:
                    ops.reduce_into(own, parts[peer][start:stop], op)
            if finish is not None:
                finish([own])
        self._meet()
        for peer in range(self.size):
            pos = starts[peer]
            for view in buf.views(lo + pos, lo + starts[peer] + counts[peer]):
                np.copyto(view, parts[peer][pos:pos + view.size])
                pos += view.size

    def _meet(self) -> None:
        """Announce this rank's arrival and wait for every other rank's."""
        self._meetings += 1
        goal = self._meetings
        counts = self._counts
        counts[self.rank][0] = goal
        for peer in range(self.size):
            if peer != self.rank and counts[peer][0] < goal:
                self._wait(goal)
                return

    def _wait(self, goal: int) -> None:
        """Wait until every count reaches ``goal``: look, then nap (see the module doc)."""
        counts = self._counts

        def late() -> list[int]:
            return [p for p in range(self.size) if p != self.rank and counts[p][0] < goal]

        until = time.monotonic() + max(self.spin_s if may_poll() else 0.0, _BRIEF_SPIN_S)
        while time.monotonic() < until:
            if not late():
                return
            _yield()
        start = time.monotonic()
        timeout = max((self._socks[p].gettimeout() or _DEFAULT_TIMEOUT_S) for p in self._socks)
        check_at = start + _SOCKET_CHECK_S
        nap = _FIRST_NAP_S
        while waiting := late():
            now = time.monotonic()
            if now >= check_at:
                self._check_alive(waiting)
                if now - start >= timeout:
                    raise CollectiveTimeoutError(
                        f"rank {self.rank} waited {timeout:.0f} s in a shared-memory allreduce "
                        f"for rank(s) {', '.join(map(str, waiting))}; they may be stalled or "
                        f"dead (raise HVD_SPARK_TIMEOUT if they are just slow)")
                check_at = now + _SOCKET_CHECK_S
            time.sleep(nap)
            nap = min(2 * nap, _MAX_NAP_S)

    def _check_alive(self, peers: list[int]) -> None:
        """Raise if the socket of one of ``peers`` is closed (without reading from it:
        a peer already past this allreduce may have sent the next operation's bytes)."""
        for peer in peers:
            sock = self._socks[peer]
            try:
                if readiness.wait_readable([sock], 0) and sock.recv(
                        1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    raise PeerDisconnectedError(
                        f"rank {peer} closed its connection while rank {self.rank} waited "
                        f"for it in a shared-memory allreduce")
            except BlockingIOError:
                continue
            except (OSError, ValueError) as exc:
                raise PeerDisconnectedError(
                    f"the connection to rank {peer} failed while rank {self.rank} waited for "
                    f"it in a shared-memory allreduce ({exc})") from None

    def close(self) -> None:
        """Unmap every segment (views still alive in a failing frame: GC unmaps)."""
        self._areas, self._counts = [], []
        unmap(self._maps)
        self._maps = []


def negotiate_arena(rank: int, size: int, socks: dict[int, socket.socket], capacity: int,
                    tag: str = "job", spin_s: float = 0.0,
                    offer: bool = True) -> HostArena | None:
    """Map every rank's segment in every rank, over the authenticated data sockets.

    Every rank of the job calls this at the same point. Each offers its segment to all
    the others, maps theirs, and tells all the others whether it mapped every one; the
    arena exists only where all did (one host, one /dev/shm, the same capacity), so all
    ranks reach the same answer. A rank that does not ``offer`` (shared memory off, a
    CPU the arena's memory order does not hold on) makes it None for all. The files are
    unlinked before this returns.

    Raises:
        PeerDisconnectedError, CollectiveTimeoutError: A peer's socket failed meanwhile.
    """
    peers = sorted(socks)
    capacity -= capacity % 64  # areas start on cache lines, aligned for every dtype
    seg_size = _DATA_OFFSET + _AREAS * capacity
    path, token, own = "", b"", None
    if offer and capacity > 0:
        try:
            path, token, own = create_segment(seg_size, tag)
        except OSError as exc:
            log.warning("cannot reserve %d bytes of shared memory for the host arena (%s); "
                        "allreduces use the ring", seg_size, exc)
    maps: dict[int, mmap.mmap] = {} if own is None else {rank: own}
    try:
        for peer in peers:  # small messages: every send fits the socket, no deadlock
            wire.send_obj(socks[peer], ("arena-offer", path, token, seg_size), f"rank {peer}")
        for peer in peers:
            _, peer_path, peer_token, peer_size = wire.recv_obj(socks[peer], f"rank {peer}")
            if own is not None and peer_path and peer_size == seg_size:
                mapping = open_segment(peer_path, peer_token, peer_size)
                if mapping is not None:
                    maps[peer] = mapping
        mapped_all = len(maps) == size
        for peer in peers:
            wire.send_obj(socks[peer], ("arena-mapped", mapped_all), f"rank {peer}")
        everyone = mapped_all
        for peer in peers:
            _, theirs = wire.recv_obj(socks[peer], f"rank {peer}")
            everyone = everyone and bool(theirs)
    except HvdSparkError:
        unmap(maps.values())
        raise
    finally:
        unlink_quietly(path)
    if not everyone:
        unmap(maps.values())
        return None
    return HostArena(rank, size, [maps[r] for r in range(size)], capacity, socks, spin_s)
