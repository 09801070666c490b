"""Shared-memory links between ranks on one host.

Each direction of a pair is a ring of slots in a file mapped by both processes;
the writer copies a chunk into a free slot and says READY over the pair's socket,
the reader reduces straight out of the slot and answers ACK. The socket only
carries 9-byte notices, and blocking on it (not spinning) keeps oversubscribed
hosts fair. Files are unlinked as soon as both sides have mapped them, so
nothing is left behind even if a rank is killed.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import hashlib
import logging
import mmap
import os
import socket
import tempfile
from collections.abc import Iterable, Sequence

import numpy as np

from hvd_spark.collectives import ops
from hvd_spark.collectives.buffers import nbytes_of
from hvd_spark.collectives.communicator import may_poll
from hvd_spark.collectives.tcp import readiness, wire
from hvd_spark.collectives.tcp.links import (
    HEADER,
    KIND_SHM_ACK,
    KIND_SHM_READY,
    Link,
    check_header,
)
from hvd_spark.errors import CollectiveError, HvdSparkError

log = logging.getLogger(__name__)

_TOKEN_BYTES = 16
_DATA_OFFSET = 4096
DEFAULT_SLOTS = 4
_ACK = HEADER.pack(KIND_SHM_ACK, 0)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def split_views(views: Sequence[np.ndarray], max_bytes: int) -> list[list[np.ndarray]]:
    """Cut a view list into consecutive parts of at most ``max_bytes`` each."""
    parts: list[list[np.ndarray]] = []
    current: list[np.ndarray] = []
    room = max_bytes
    for view in views:
        start = 0
        while start < view.size:
            take = min(view.size - start, room // view.itemsize)
            if take == 0:
                parts.append(current)
                current, room = [], max_bytes
                continue
            current.append(view[start : start + take])
            room -= take * view.itemsize
            start += take
    if current or not parts:
        parts.append(current)
    return parts


class ShmLink(Link):
    """A link whose bytes travel through two shared-memory slot rings.

    Args:
        sock: Authenticated socket to the peer, used for READY/ACK notices.
        peer: The peer's rank.
        out_map: Mapping this rank writes and the peer reads.
        in_map: Mapping the peer writes and this rank reads.
        slot_bytes: Bytes per slot.
        nslots: Slots per direction.
        spin_s: Seconds to poll for a notice before blocking on the socket, when the
            thread runs a waiting caller's operation (``communicator.may_poll``).
    """

    def __init__(
        self,
        sock: socket.socket,
        peer: int,
        out_map: mmap.mmap,
        in_map: mmap.mmap,
        slot_bytes: int,
        nslots: int,
        spin_s: float = 0.0,
    ) -> None:
        self.sock = sock
        self.spin_s = spin_s
        self.peer = peer
        self._what = f"rank {peer}"
        self._out_map, self._in_map = out_map, in_map
        self._out = np.frombuffer(out_map, np.uint8)
        self._in = np.frombuffer(in_map, np.uint8)
        self.slot_bytes = slot_bytes
        self.nslots = nslots
        self._written = 0
        self._acked = 0
        self._read = 0
        self._ready: collections.deque[int] = collections.deque()

    def _slot(self, base: np.ndarray, seq: int) -> np.ndarray:
        start = _DATA_OFFSET + (seq % self.nslots) * self.slot_bytes
        return base[start : start + self.slot_bytes]

    def _pump(self) -> None:
        """Read one notice from the peer and account for it."""
        if may_poll():  # for a waiting caller only: a background thread would steal compute
            readiness.poll_readable([self.sock], self.spin_s)
        kind, nbytes = HEADER.unpack(wire.recv_exact(self.sock, HEADER.size, self._what))
        if kind == KIND_SHM_READY:
            self._ready.append(nbytes)
        elif kind == KIND_SHM_ACK:
            self._acked += 1
        else:
            raise CollectiveError(f"protocol error with rank {self.peer}: notice kind {kind}")

    def send(self, views: Sequence[np.ndarray]) -> None:
        for part in split_views(views, self.slot_bytes):
            while self._written - self._acked >= self.nslots:
                self._pump()
            slot = self._slot(self._out, self._written)
            offset = 0
            for view in part:
                src = view.view(np.uint8)
                np.copyto(slot[offset : offset + src.size], src)
                offset += src.size
            wire.send_all(self.sock, HEADER.pack(KIND_SHM_READY, offset), self._what)
            self._written += 1

    def wait_sent(self) -> None:
        """Sends complete synchronously into shared memory."""

    def _next_ready(self, nbytes: int) -> np.ndarray:
        while not self._ready:
            self._pump()
        check_header(KIND_SHM_READY, self._ready.popleft(), KIND_SHM_READY, nbytes, self.peer)
        return self._slot(self._in, self._read)

    def _release(self) -> None:
        self._read += 1
        wire.send_all(self.sock, _ACK, self._what)

    def recv_into(self, views: Sequence[np.ndarray]) -> None:
        for part in split_views(views, self.slot_bytes):
            slot = self._next_ready(nbytes_of(part))
            offset = 0
            for view in part:
                dst = view.view(np.uint8)
                np.copyto(dst, slot[offset : offset + dst.size])
                offset += dst.size
            self._release()

    def recv_reduce(self, views: Sequence[np.ndarray], op: ops.ReduceOp,
                    bases: Sequence[np.ndarray] | None = None) -> None:
        parts = split_views(views, self.slot_bytes)
        base_parts = (split_views(bases, self.slot_bytes) if bases is not None
                      else [None] * len(parts))
        for part, base_part in zip(parts, base_parts):
            slot = self._next_ready(nbytes_of(part))
            offset = 0
            for i, view in enumerate(part):
                incoming = slot[offset : offset + view.nbytes].view(view.dtype)
                ops.reduce_into(view, incoming, op, None if base_part is None else base_part[i])
                offset += view.nbytes
            self._release()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        # Each map holds a descriptor of its segment: unmap now, so a closed link holds
        # none. Views into a map may still be alive in a failing frame; then GC unmaps.
        self._out = self._in = None  # type: ignore[assignment]
        unmap([self._out_map, self._in_map])  # (None once closed)
        self._out_map = self._in_map = None  # type: ignore[assignment]


def unmap(mappings: Iterable[mmap.mmap | None]) -> None:
    """Close each mapping (None: skipped); one a view still holds, in a failing frame,
    is left for GC to unmap."""
    for mapping in mappings:
        if mapping is None:
            continue
        try:
            mapping.close()
        except BufferError:
            pass


def unlink_quietly(path: str) -> None:
    """Remove a segment file once every rank mapped it (or gave up); gone already: fine."""
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)


def job_tag(secret: bytes) -> str:
    """A short public tag of a job (derived from, not revealing, its secret)."""
    return hashlib.sha256(b"shm-tag" + secret).hexdigest()[:12]


def remove_segments(tag: str) -> int:
    """Unlink the job's segment files a killed rank may have left; returns how many.

    Segments are unlinked as soon as both sides mapped them; only a rank killed in
    that window leaves one, so launchers call this when a job ends.
    """
    removed = 0
    for path in glob.glob(os.path.join(_shm_dir(), f"hvd_spark_{tag}_*")):
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed += 1
    return removed


def create_segment(size: int, tag: str) -> tuple[str, bytes, mmap.mmap]:
    """Create and map a segment file of ``size`` bytes: (its path, the token written at
    its start for the peers to check, the mapping). The caller unlinks the file.

    Raises:
        OSError: The pages cannot be reserved (a full /dev/shm) or the file made.
    """
    token = os.urandom(_TOKEN_BYTES)
    path = os.path.join(_shm_dir(), f"hvd_spark_{tag}_{os.getpid()}_{token.hex()[:16]}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # Reserve the pages now: a sparse file on a full /dev/shm would SIGBUS at the
        # first write; an error here lets the caller fall back to TCP instead.
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:  # macOS: no reservation call; a sparse file as before
            os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    else:
        os.close(fd)
    mapping[:_TOKEN_BYTES] = token
    return path, token, mapping


def open_segment(path: str, token: bytes, size: int) -> mmap.mmap | None:
    """Map a peer's segment, or None when this rank cannot see it (another host, another
    /dev/shm) or it is not the one offered (size or token differ)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None  # another host, or another /dev/shm: fall back to TCP
    try:
        if os.fstat(fd).st_size != size:
            return None
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if mapping[:_TOKEN_BYTES] != token:
        mapping.close()
        return None
    return mapping


def negotiate_segments(sock: socket.socket, peer: int, size: int, tag: str = "job",
                       offer: bool = True, instead: str = "using TCP with that rank",
                       ) -> tuple[mmap.mmap, mmap.mmap] | None:
    """Map a segment of ``size`` bytes each way with ``peer``, over its authenticated socket.

    Both sides call this at the same point; it returns (the segment this rank writes, the
    one the peer writes) only if both could map each other's (same host, same /dev/shm),
    else None on both sides. ``tag`` (see ``job_tag``) names the files so a launcher can
    remove leftovers; the files are unlinked before this returns. A rank that does not
    ``offer`` a segment takes part in the exchange and gets None, as does its peer.
    ``instead`` ends the warning logged when this rank cannot reserve its segment.
    """
    what = f"rank {peer}"
    path, token, out_map = "", b"", None
    if offer:
        try:
            path, token, out_map = create_segment(size, tag)
        except OSError as exc:
            log.warning("cannot reserve %d bytes of shared memory for rank %d in %s (%s); "
                        "%s", size, peer, _shm_dir(), exc, instead)
    try:
        wire.send_obj(sock, ("shm-offer", path, token, size), what)
        _, peer_path, peer_token, peer_size = wire.recv_obj(sock, what)
        in_map = open_segment(peer_path, peer_token, peer_size) if peer_path else None
        wire.send_obj(sock, ("shm-mapped", in_map is not None), what)
        _, peer_mapped = wire.recv_obj(sock, what)
    except HvdSparkError:
        unmap([out_map])
        raise
    finally:
        unlink_quietly(path)
    if out_map is not None and in_map is not None and peer_mapped:
        return out_map, in_map
    unmap([out_map, in_map])
    return None


def negotiate_shm(
    sock: socket.socket, peer: int, slot_bytes: int, nslots: int = DEFAULT_SLOTS,
    tag: str = "job", spin_s: float = 0.0,
) -> ShmLink | None:
    """Try to set up a ShmLink with ``peer`` over its authenticated socket.

    Both sides call this at the same point; it returns a link only if both could
    map each other's segment (same host, same /dev/shm), else None on both sides.
    ``tag`` (see ``job_tag``) names the files so a launcher can remove leftovers.
    """
    maps = negotiate_segments(sock, peer, _DATA_OFFSET + slot_bytes * nslots, tag)
    if maps is None:
        return None
    return ShmLink(sock, peer, maps[0], maps[1], slot_bytes, nslots, spin_s)
