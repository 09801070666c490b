"""Connecting the ranks: every pair gets an authenticated data socket, and every
rank a control socket to the coordinator (rank 0).

Each rank listens, publishes its address in the rendezvous store, dials the
ranks below it and accepts the ranks above it. A connection that fails the
handshake is dropped and counted; the formation goes on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import sys
import threading
import time

from hvd_spark.collectives.tcp import readiness, wire
from hvd_spark.collectives.tcp.store import StoreClient
from hvd_spark.errors import (
    AuthenticationError,
    HvdSparkError,
    PeerDisconnectedError,
    RendezvousTimeoutError,
)

log = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.2
# A local peer's Unix socket answers at once or not at all (another network namespace).
_LOCAL_DIAL_S = 2.0

DATA = "data"
CONTROL = "ctrl"


@dataclasses.dataclass
class Mesh:
    """The sockets of one rank after formation.

    Attributes:
        data: Peer rank -> data socket (every other rank).
        control: Peer rank -> control socket (rank 0: all others; others: {0: sock}).
        hosts: Rank -> hostname as each rank reported it.
        rejected: Connections dropped for failing authentication.
    """

    data: dict[int, socket.socket]
    control: dict[int, socket.socket]
    hosts: dict[int, str]
    rejected: int = 0


class _Acceptor:
    """Accepts and authenticates the connections a rank expects, in the background,
    on any of its listeners (TCP, and a Unix socket for ranks on this host)."""

    def __init__(self, listeners: list[socket.socket], secret: bytes,
                 expected: set[tuple[str, int]]):
        self._listeners = listeners
        self._secret = secret
        self._expected = expected
        self.accepted: dict[tuple[str, int], socket.socket] = {}
        self.rejected = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hvd-accept", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        # Closing a listener does not wake a thread blocked in accept() on Linux: poll
        # with a short timeout so stop() ends this thread instead of leaking it.
        while not self._stop.is_set():
            try:
                readable = readiness.wait_readable(self._listeners, _ACCEPT_POLL_S)
                if not readable:
                    continue
                conn, peer = readable[0].accept()
            except (OSError, ValueError):
                return  # the listener was closed
            threading.Thread(target=self._handshake, args=(conn, peer),
                             name="hvd-handshake", daemon=True).start()

    def stop(self) -> None:
        """End the accept loop (bounded wait); the caller closes the listener after."""
        self._stop.set()
        self._thread.join(2 * _ACCEPT_POLL_S + 1.0)

    def _handshake(self, conn: socket.socket, peer: tuple) -> None:
        try:
            wire.tune(conn)
            wire.authenticate_server(conn, self._secret)
            conn.settimeout(wire.HANDSHAKE_TIMEOUT_S)
            purpose, rank = wire.recv_obj(conn, "connecting rank")
        except (AuthenticationError, HvdSparkError, OSError) as exc:
            log.warning("dropped a connection from %s: %s", peer[0] if peer else "this host",
                        exc)
            with self._cond:
                self.rejected += 1
            conn.close()
            return
        with self._cond:
            if (purpose, rank) not in self._expected or (purpose, rank) in self.accepted:
                conn.close()
                return
            self.accepted[(purpose, rank)] = conn
            self._cond.notify_all()

    def wait(self, deadline: float) -> None:
        with self._cond:
            while len(self.accepted) < len(self._expected):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(self._expected - set(self.accepted))
                    raise RendezvousTimeoutError(
                        f"ranks {[r for _, r in missing]} did not connect in time; "
                        "they may have failed to start (see their logs) or a firewall blocks them"
                    )
                self._cond.wait(min(left, 1.0))


def _unreachable(peer: int, peer_host: str, addr: str, exc: Exception) -> PeerDisconnectedError:
    # The usual cause on a multi-homed host: the peer advertised the address of an
    # interface the other hosts cannot reach (or this host cannot).
    return PeerDisconnectedError(
        f"{exc}; rank {peer} on host {peer_host} advertised {addr}, which this host cannot "
        "reach: set HVD_SPARK_IFACE (or HOROVOD_GLOO_IFACE, hvdrun --network-interface) to "
        "the interface of the network the hosts share, or HVD_SPARK_ADVERTISE_ADDR")


def _unix_listener(secret: bytes, epoch: int, rank: int,
                   backlog: int) -> tuple[socket.socket | None, str]:
    """A Unix socket in Linux's abstract namespace for ranks on this host to dial (no
    file to clean up; named from the job's secret, epoch and rank), or (None, "")."""
    if not hasattr(socket, "AF_UNIX") or not sys.platform.startswith("linux"):
        return None, ""
    tag = hashlib.sha256(b"hvd-unix" + secret).hexdigest()[:16]
    name = f"hvd_spark.{tag}.{os.getpid()}.{epoch}.{rank}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + name)
        listener.listen(backlog)
    except OSError as exc:
        log.debug("no Unix socket for local ranks (%s); they connect over TCP", exc)
        listener.close()
        return None, ""
    return listener, name


def _dial(peer: int, info: tuple, hostname: str, secret: bytes, left: float) -> socket.socket:
    """Connect to ``peer``: through its Unix socket when it runs on this host (a tenth of
    the per-message cost of loopback TCP), else (or when that fails) over TCP."""
    host, port, peer_host, unix_name = (*info, "")[:4]
    if unix_name and peer_host == hostname:
        try:
            return wire.connect_unix(unix_name, secret, min(left, _LOCAL_DIAL_S))
        except (PeerDisconnectedError, OSError) as exc:
            # Same hostname but another network namespace (a container): TCP reaches it.
            log.debug("rank %d's Unix socket is not reachable (%s); dialling TCP", peer, exc)
    try:
        return wire.connect((host, port), secret, left, f"rank {peer}")
    except PeerDisconnectedError as exc:
        raise _unreachable(peer, peer_host, host, exc) from None


def build_mesh(
    rank: int,
    size: int,
    store: StoreClient,
    secret: bytes,
    hostname: str,
    advertise_addr: str,
    timeout: float,
    epoch: int = 0,
    local_sockets: bool = True,
    connect_timeout: float | None = None,
) -> Mesh:
    """Form the full mesh for this rank; blocks until all its sockets are connected.

    Args:
        rank, size: This rank and the world size.
        store: Client of the launcher's rendezvous store.
        secret: Job secret for every handshake.
        hostname: Reported to peers to group ranks by host.
        advertise_addr: Address peers dial; empty: our address as the store sees it.
        timeout: Seconds to wait for every peer to publish its address (a peer may still
            be starting), and the default of ``connect_timeout``.
        epoch: Distinguishes repeated ``init()`` calls in one job.
        local_sockets: Ranks on this host connect through Unix sockets (False: loopback
            TCP, as with shared memory off, so a run measures what crosses hosts).
        connect_timeout: Seconds for the connections once every address is known: every
            peer is up and listening by then, so an address that cannot be dialled within
            it is unreachable (a wrong interface), not slow.
    """
    addr = advertise_addr or store.local_address
    backlog = max(16, 2 * size)  # every other rank may dial at once, twice (data, control)
    listener = socket.create_server((addr, 0), backlog=backlog)
    unix, unix_name = (_unix_listener(secret, epoch, rank, backlog) if local_sockets
                       else (None, ""))
    expected = {(DATA, r) for r in range(rank + 1, size)}
    if rank == 0:
        expected |= {(CONTROL, r) for r in range(1, size)}
    acceptor = _Acceptor([listener] + ([unix] if unix is not None else []), secret, expected)
    try:
        store.set(f"mesh/{epoch}/{rank}",
                  (addr, listener.getsockname()[1], hostname, unix_name))
        peers = {r: store.get(f"mesh/{epoch}/{r}", timeout) for r in range(size) if r != rank}
        deadline = time.monotonic() + (timeout if connect_timeout is None else connect_timeout)
        data: dict[int, socket.socket] = {}
        control: dict[int, socket.socket] = {}
        dials = [(DATA, r) for r in range(rank)] + ([(CONTROL, 0)] if rank > 0 else [])
        for purpose, peer in dials:
            left = max(1.0, deadline - time.monotonic())
            sock = _dial(peer, peers[peer], hostname, secret, left)
            wire.send_obj(sock, (purpose, rank), f"rank {peer}")
            (data if purpose == DATA else control)[peer] = sock
        acceptor.wait(deadline)
        for (purpose, peer), sock in acceptor.accepted.items():
            (data if purpose == DATA else control)[peer] = sock
    finally:
        acceptor.stop()
        listener.close()
        if unix is not None:
            unix.close()
    for sock in [*data.values(), *control.values()]:
        sock.settimeout(timeout)
    hosts = {r: info[2] for r, info in peers.items()}
    hosts[rank] = hostname
    return Mesh(data=data, control=control, hosts=hosts, rejected=acceptor.rejected)
