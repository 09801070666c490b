"""The TCP backend, with and without its shared-memory path, against the contract."""

from __future__ import annotations

import threading

import pytest

from hvd_spark.collectives.tcp.communicator import TcpCommunicator
from hvd_spark.collectives.tcp.express_lane import lane_supported
from hvd_spark.collectives.tcp.links import TcpLink
from hvd_spark.collectives.tcp.mesh import build_mesh
from hvd_spark.collectives.tcp.shm import ShmLink
from hvd_spark.collectives.tcp.store import StoreClient, StoreServer
from tests.contract.communicator_contract import CommunicatorContract, run_parallel

SECRET = b"contract-secret-0123456789abcdef"


def make_tcp(size: int, use_shm: bool, chunk_bytes: int = 64 * 1024,
             spin_s: float = 0.0, express_lane_bytes: int = 0,
             arena_bytes: int = 0) -> list[TcpCommunicator]:
    """Form a real mesh of ``size`` ranks over loopback, one thread per rank (ranks on
    one host connect through Unix sockets with shared memory on, TCP without, as in jobs)."""
    server = StoreServer(SECRET)
    comms: list = [None] * size

    def body(rank):
        store = StoreClient(("127.0.0.1", server.port), SECRET)
        mesh = build_mesh(rank, size, store, SECRET, "host", "", timeout=30,
                          local_sockets=use_shm)
        store.close()
        for sock in mesh.control.values():
            sock.close()  # the contract exercises data paths only
        comms[rank] = TcpCommunicator(rank, size, mesh.data, chunk_bytes, use_shm,
                                      spin_s=spin_s, express_lane_bytes=express_lane_bytes,
                                      arena_bytes=arena_bytes)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    server.close()
    assert all(c is not None for c in comms), "mesh formation failed"
    return comms


class TestTcpWithShm(CommunicatorContract):
    def make(self, size):
        comms = make_tcp(size, use_shm=True)
        for c in comms:
            assert all(isinstance(c.links[p], ShmLink) for p in (c.left_rank, c.right_rank))
        return comms


class TestTcpWithShmPolling(CommunicatorContract):
    """Shared-memory links that poll for notices before blocking (as a waiting caller's
    operations run in jobs)."""

    @pytest.fixture(autouse=True)
    def _as_waiting_callers(self, monkeypatch):
        from hvd_spark.collectives.tcp import shm

        monkeypatch.setattr(shm, "may_poll", lambda: True)

    def make(self, size):
        comms = make_tcp(size, use_shm=True, spin_s=1e-3)
        for c in comms:
            assert all(c.links[p].spin_s == 1e-3 for p in (c.left_rank, c.right_rank))
        return comms


class TestTcpOnly(CommunicatorContract):
    def make(self, size):
        comms = make_tcp(size, use_shm=False)
        for c in comms:
            assert all(isinstance(link, TcpLink) for link in c.links.values())
        return comms


class TestTcpOnlyTwoRanks(CommunicatorContract):
    """Two ranks over TCP: both ring directions share one socket, and every step of
    64 KB or more sends and receives at once from the caller's thread (``duplex``);
    the chunk is no multiple of the dtypes' sizes."""

    size = 2

    def make(self, size):
        return make_tcp(size, use_shm=False, chunk_bytes=100_003)


class TestTcpTwoRanks(CommunicatorContract):
    """Two ranks sharing memory, with the express lane their engine would use."""

    size = 2

    def make(self, size):
        comms = make_tcp(size, use_shm=True, express_lane_bytes=1 << 20)
        assert all((c.express_lane is not None) == lane_supported() for c in comms)
        return comms


class TestTcpArena(CommunicatorContract):
    """Three ranks on one host: allreduces go through the host arena, in pieces of 64 KB
    (so the larger cases take several pieces, through both areas); the other collectives
    ride the ring."""

    def make(self, size):
        comms = make_tcp(size, use_shm=True, arena_bytes=64 * 1024)
        assert all((c.arena is not None) == lane_supported() for c in comms)
        return comms


class TestTcpArenaFourRanks(TestTcpArena):
    """Four ranks: ranks 0 and 2 share no ring link, only the arena; pieces of an odd size
    (no multiple of any dtype's)."""

    size = 4

    def make(self, size):
        comms = make_tcp(size, use_shm=True, arena_bytes=100_003)
        assert all((c.arena is not None) == lane_supported() for c in comms)
        return comms


def test_two_ranks_keep_the_ring():
    """The arena is for three ranks and more: two ranks keep the ring (and the lane)."""
    comms = make_tcp(2, use_shm=True, express_lane_bytes=1 << 20, arena_bytes=64 * 1024)
    try:
        assert all(c.arena is None for c in comms)
        assert all((c.express_lane is not None) == lane_supported() for c in comms)
    finally:
        for c in comms:
            c.close()


def test_single_rank_is_a_noop():
    (comm,) = make_tcp(1, use_shm=True)
    import numpy as np

    from hvd_spark.collectives import ops
    from hvd_spark.collectives.buffers import SegmentedBuffer

    a = np.arange(5.0)
    run_parallel([comm], lambda c: c.allreduce(SegmentedBuffer([a]), ops.Sum))
    assert a.tolist() == [0, 1, 2, 3, 4]


def test_mesh_drops_intruder_and_still_forms():
    """A connection without the secret during formation is dropped; the ranks connect anyway."""
    import socket

    import pytest

    from hvd_spark.collectives.tcp import wire
    from hvd_spark.errors import AuthenticationError

    server = StoreServer(SECRET)
    meshes: dict = {}
    intruder: dict = {}

    def rank(r):
        store = StoreClient(("127.0.0.1", server.port), SECRET)
        if r == 1:
            # Rank 1 waits until the intruder has knocked on rank 0's listener.
            server.get("intruder-done", 20)
        meshes[r] = build_mesh(r, 2, store, SECRET, "host", "", timeout=30)
        store.close()

    def knock():
        host, port, _, unix_name = server.get("mesh/0/0", 20)
        try:
            # Both doors: the TCP listener and the Unix socket local ranks dial.
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.connect("\0" + unix_name)
            for sock in (socket.create_connection((host, port)), unix):
                try:
                    with pytest.raises(AuthenticationError):
                        wire.authenticate_client(sock, b"wrong-secret-wrong-secret-wrong!")
                finally:
                    sock.close()
            intruder["rejected"] = True
        finally:
            server.set("intruder-done", True)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    threads.append(threading.Thread(target=knock))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    server.close()
    assert intruder.get("rejected")
    assert set(meshes) == {0, 1} and 1 in meshes[0].data and 0 in meshes[1].data
    assert meshes[0].rejected == 2  # one at each door
    for m in meshes.values():
        for s in [*m.data.values(), *m.control.values()]:
            s.close()


def form_meshes(hostnames: list[str], local_sockets: bool = True) -> dict:
    """Form a mesh of one rank per hostname, one thread each: rank -> its Mesh."""
    server = StoreServer(SECRET)
    meshes: dict = {}

    def rank(r):
        store = StoreClient(("127.0.0.1", server.port), SECRET)
        meshes[r] = build_mesh(r, len(hostnames), store, SECRET, hostnames[r], "", timeout=30,
                               local_sockets=local_sockets)
        store.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(hostnames))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    server.close()
    assert set(meshes) == set(range(len(hostnames))), "mesh formation failed"
    return meshes


def _families(mesh) -> set:
    return {s.family for s in [*mesh.data.values(), *mesh.control.values()]}


def test_local_ranks_connect_through_unix_sockets_remote_ones_over_tcp():
    """Ranks reporting one hostname share Unix sockets; another host's rank gets TCP."""
    import socket

    meshes = form_meshes(["a", "a", "b"])
    assert meshes[0].data[1].family == socket.AF_UNIX
    assert meshes[0].control[1].family == socket.AF_UNIX
    assert meshes[1].control[0].family == socket.AF_UNIX
    assert meshes[2].data[0].family == socket.AF_INET
    assert meshes[2].data[1].family == socket.AF_INET
    assert meshes[2].control[0].family == socket.AF_INET
    # Frames cross a Unix control socket as they cross TCP.
    from hvd_spark.collectives.tcp import wire

    wire.send_obj(meshes[1].control[0], ("req", [1, 2]), "rank 0")
    assert wire.recv_obj(meshes[0].control[1], "rank 1") == ("req", [1, 2])
    for mesh in meshes.values():
        for sock in [*mesh.data.values(), *mesh.control.values()]:
            sock.close()


def test_without_local_sockets_every_connection_is_tcp():
    """Shared memory off (what crossing hosts measures): loopback TCP throughout."""
    import socket

    meshes = form_meshes(["a", "a"], local_sockets=False)
    assert _families(meshes[0]) == _families(meshes[1]) == {socket.AF_INET}
    for mesh in meshes.values():
        for sock in [*mesh.data.values(), *mesh.control.values()]:
            sock.close()


def test_dial_falls_back_to_tcp_when_the_unix_socket_is_unreachable():
    """Same hostname but another network namespace: the Unix name is not there; TCP is."""
    import socket

    from hvd_spark.collectives.tcp import mesh as mesh_mod
    from hvd_spark.collectives.tcp import wire

    listener = socket.create_server(("127.0.0.1", 0))
    accepted: dict = {}

    def serve():
        conn, _ = listener.accept()
        wire.authenticate_server(conn, SECRET)
        accepted["conn"] = conn

    server = threading.Thread(target=serve)
    server.start()
    info = ("127.0.0.1", listener.getsockname()[1], "host", "hvd_spark.nobody-listens-here")
    sock = mesh_mod._dial(0, info, "host", SECRET, 10.0)
    server.join(10)
    listener.close()
    assert sock.family == socket.AF_INET and "conn" in accepted
    sock.close()
    accepted["conn"].close()
