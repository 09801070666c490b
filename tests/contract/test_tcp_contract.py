"""The TCP backend, with and without its shared-memory path, against the contract."""

from __future__ import annotations

import threading

from hvd_spark.collectives.tcp.communicator import TcpCommunicator
from hvd_spark.collectives.tcp.links import TcpLink
from hvd_spark.collectives.tcp.mesh import build_mesh
from hvd_spark.collectives.tcp.shm import ShmLink
from hvd_spark.collectives.tcp.store import StoreClient, StoreServer
from tests.contract.communicator_contract import CommunicatorContract, run_parallel

SECRET = b"contract-secret-0123456789abcdef"


def make_tcp(size: int, use_shm: bool, chunk_bytes: int = 64 * 1024) -> list[TcpCommunicator]:
    """Form a real mesh of ``size`` ranks over loopback, one thread per rank."""
    server = StoreServer(SECRET)
    comms: list = [None] * size

    def body(rank):
        store = StoreClient(("127.0.0.1", server.port), SECRET)
        mesh = build_mesh(rank, size, store, SECRET, "host", "", timeout=30)
        store.close()
        for sock in mesh.control.values():
            sock.close()  # the contract exercises data paths only
        comms[rank] = TcpCommunicator(rank, size, mesh.data, chunk_bytes, use_shm)

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


class TestTcpOnly(CommunicatorContract):
    def make(self, size):
        comms = make_tcp(size, use_shm=False)
        for c in comms:
            assert all(isinstance(link, TcpLink) for link in c.links.values())
        return comms


class TestTcpTwoRanks(CommunicatorContract):
    size = 2

    def make(self, size):
        return make_tcp(size, use_shm=True)


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
        host, port, _ = server.get("mesh/0/0", 20)
        sock = socket.create_connection((host, port))
        try:
            with pytest.raises(AuthenticationError):
                wire.authenticate_client(sock, b"wrong-secret-wrong-secret-wrong!")
            intruder["rejected"] = True
        finally:
            sock.close()
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
    assert meshes[0].rejected == 1
    for m in meshes.values():
        for s in [*m.data.values(), *m.control.values()]:
            s.close()
