"""One MPI rank serving its MpiCommunicator to a test process (run under mpirun).

The contract tests drive every rank's communicator from one pytest process, a thread
per rank; under MPI each rank is its own process, so each rank runs this server and
the test talks to it over an authenticated socket. The collectives themselves run on
real MPI between the real rank processes.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from mpi4py import MPI

from hvd_spark import errors
from hvd_spark.collectives.buffers import SegmentedBuffer
from hvd_spark.collectives.mpi.communicator import MpiCommunicator
from hvd_spark.collectives.mpi.waiting import AbortChannel
from hvd_spark.collectives.tcp import wire

ADDR_VAR = "HVD_TEST_MPI_PROXY_ADDR"
SECRET_VAR = "HVD_TEST_MPI_PROXY_SECRET"
TIMEOUT_VAR = "HVD_TEST_MPI_PROXY_TIMEOUT"


def _buffer(pieces: list[np.ndarray], dtype: str) -> SegmentedBuffer:
    return SegmentedBuffer(pieces or [np.empty(0, dtype)])


def serve(comm: MpiCommunicator, sock) -> None:
    """Answer (method, args) calls until ``close``."""
    while True:
        method, args = wire.recv_obj(sock, "test")
        try:
            if method == "close":
                comm.close()
                wire.send_obj(sock, ("ok", None), "test")
                return
            if method == "alltoall":
                send, send_counts, recv, recv_counts = args
                comm.alltoall(send, send_counts, recv, recv_counts)
                result = recv
            else:
                pieces, dtype, *rest = args
                buf = _buffer(pieces, dtype)
                getattr(comm, method)(buf, *rest)
                result = buf.pieces
            wire.send_obj(sock, ("ok", result), "test")
        except errors.HvdSparkError as exc:
            wire.send_obj(sock, ("err", type(exc).__name__, str(exc)), "test")


def main() -> int:
    host, port = wire.parse_addr(os.environ[ADDR_VAR])
    secret = bytes.fromhex(os.environ[SECRET_VAR])
    world = MPI.COMM_WORLD
    timeout = float(os.environ.get(TIMEOUT_VAR, "60"))
    comm = MpiCommunicator(world.Dup(), timeout=timeout, abort=AbortChannel(world.Dup()))
    sock = wire.connect((host, port), secret, 60.0, "the test process")
    wire.send_obj(sock, comm.rank, "test")
    serve(comm, sock)
    sock.close()
    if comm.channel.notice is not None:
        # A peer gave up mid-collective: its requests can never complete, and MPI_Finalize
        # could wait for them. Leave without it (mpirun reports it; the test does not care).
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
