"""The MPI backend against the communicator contract, on real ranks started by mpirun.

Each rank is an MPI process serving its MpiCommunicator (``mpi_ranks.py``); a proxy per
rank lets the contract drive them from this process, one thread per rank, as it drives
the TCP backend's in-process ranks. The bytes move over MPI between the rank processes.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from hvd_spark import errors
from hvd_spark.collectives.buffers import SegmentedBuffer
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.tcp import wire
from hvd_spark.runner.local.mpi_launcher import mpirun_command
from tests.contract import mpi_ranks
from tests.contract.communicator_contract import CommunicatorContract

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ProxyCommunicator(Communicator):
    """Forwards each call to one rank process and copies the result back in place."""

    name = "mpi-proxy"

    def __init__(self, sock: socket.socket, rank: int, size: int) -> None:
        self.sock, self.rank, self.size = sock, rank, size
        self.closed = False

    def _call(self, method: str, args):
        wire.send_obj(self.sock, (method, args), f"rank {self.rank}")
        reply = wire.recv_obj(self.sock, f"rank {self.rank}")
        if reply[0] == "err":
            raise getattr(errors, reply[1], errors.CollectiveError)(reply[2])
        return reply[1]

    def _buffer_call(self, method: str, buf: SegmentedBuffer, *rest) -> None:
        result = self._call(method, (buf.pieces, buf.dtype.str, *rest))
        for piece, value in zip(buf.pieces, result):
            piece[...] = value

    def allreduce(self, buf, op):
        self._buffer_call("allreduce", buf, op)

    def reducescatter(self, buf, op, counts):
        self._buffer_call("reducescatter", buf, op, list(counts))

    def allgather(self, buf, counts):
        self._buffer_call("allgather", buf, list(counts))

    def broadcast(self, buf, root):
        self._buffer_call("broadcast", buf, root)

    def alltoall(self, send, send_counts, recv, recv_counts):
        recv[...] = self._call("alltoall", (send, list(send_counts), recv, list(recv_counts)))

    def close(self):
        if self.closed:
            return
        self.closed = True
        try:
            self._call("close", None)
        except errors.HvdSparkError:
            pass  # the rank process is gone already
        self.sock.close()


def start_mpi_ranks(size: int, timeout: float = 60.0
                    ) -> tuple[list[ProxyCommunicator], subprocess.Popen]:
    """mpirun ``size`` rank servers (collective deadline ``timeout``); return their proxies."""
    secret = secrets.token_bytes(32)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)
    env = {mpi_ranks.ADDR_VAR: f"127.0.0.1:{listener.getsockname()[1]}",
           mpi_ranks.SECRET_VAR: secret.hex(), mpi_ranks.TIMEOUT_VAR: str(timeout),
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    args, full_env = mpirun_command(size, [sys.executable, "-m", "tests.contract.mpi_ranks"], env)
    full_env.pop("HVD_SPARK_BACKEND", None)
    proc = subprocess.Popen(args, env=full_env, cwd=ROOT)
    proxies: dict[int, ProxyCommunicator] = {}
    try:
        while len(proxies) < size:
            sock, _ = listener.accept()
            wire.authenticate_server(sock, secret)
            sock.settimeout(120)
            rank = wire.recv_obj(sock, "rank")
            proxies[rank] = ProxyCommunicator(sock, rank, size)
    except BaseException:
        proc.kill()
        proc.wait(30)
        raise
    finally:
        listener.close()
    return [proxies[r] for r in range(size)], proc


class MpiContract(CommunicatorContract):
    @pytest.fixture
    def comms(self):
        comms, proc = start_mpi_ranks(self.size)
        yield comms
        for c in comms:
            c.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()  # a rank left waiting in MPI_Finalize after a peer aborted
            proc.wait(30)


class TestMpiThreeRanks(MpiContract):
    size = 3


class TestMpiTwoRanks(MpiContract):
    size = 2


def test_a_rank_that_left_fails_the_other_promptly():
    """MPI cannot interrupt a collective; our abort notice ends the survivor's wait at once."""
    comms, proc = start_mpi_ranks(2)
    try:
        # The ranks' timeout is 60 s: only the notice can make this fast.
        start = time.monotonic()
        comms[1].close()  # rank 1 leaves: rank 0's allreduce must fail promptly
        with pytest.raises(errors.CollectiveError, match="rank 1"):
            comms[0].allreduce(SegmentedBuffer([np.ones(4)]), 1)
        assert time.monotonic() - start < 10
    finally:
        for c in comms:
            c.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def test_a_collective_nobody_joins_fails_at_its_deadline():
    """MPI has no timeouts; ours do: a lone allreduce raises CollectiveTimeoutError."""
    comms, proc = start_mpi_ranks(2, timeout=2.0)
    try:
        start = time.monotonic()
        with pytest.raises(errors.CollectiveTimeoutError, match="did not complete"):
            comms[0].allreduce(SegmentedBuffer([np.ones(4)]), 1)
        assert 1.5 < time.monotonic() - start < 20
    finally:
        for c in comms:
            c.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
