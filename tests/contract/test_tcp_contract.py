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
