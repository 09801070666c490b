"""Small exchanges over the host communicator that the device paths need to start.

Device discovery (every rank's host and GPU), the NCCL unique id and CUDA IPC handles
travel over the job's host communicator: its connections proved the job's secret
(HMAC) before anything was trusted, as the rendezvous store's did, and unlike the
store it exists in every kind of job (Spark, hvdrun, mpirun) and is already scoped to
this ring generation and process set, so no key can be stale.
"""

from __future__ import annotations

import numpy as np

from hvd_spark.collectives.buffers import SegmentedBuffer
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.errors import CollectiveError

NCCL_UNIQUE_ID_BYTES = 128


def allgather_bytes(comm: Communicator, payload: bytes) -> list[bytes]:
    """Every rank's ``payload``, in rank order (a collective over ``comm``)."""
    # A one-byte prefix keeps every count positive (some rings skip empty segments).
    mine = b"\x01" + payload
    lengths = np.zeros(comm.size, np.int64)
    lengths[comm.rank] = len(mine)
    comm.allgather(SegmentedBuffer([lengths]), [1] * comm.size)
    counts = [int(n) for n in lengths]
    data = np.zeros(sum(counts), np.uint8)
    start = sum(counts[: comm.rank])
    data[start : start + len(mine)] = np.frombuffer(mine, np.uint8)
    comm.allgather(SegmentedBuffer([data]), counts)
    out, start = [], 0
    for n in counts:
        out.append(data[start + 1 : start + n].tobytes())
        start += n
    return out


def broadcast_unique_id(comm: Communicator, root: int, unique_id: bytes | None) -> bytes:
    """The root's NCCL unique id on every rank of ``comm``.

    Args:
        comm: The host communicator of the ranks that will form the NCCL communicator.
        root: Rank (in ``comm``) that created the id.
        unique_id: The id on the root (``NCCL_UNIQUE_ID_BYTES`` bytes), None elsewhere.

    Raises:
        CollectiveError: The root's id does not have NCCL's size.
    """
    buf = np.zeros(NCCL_UNIQUE_ID_BYTES + 1, np.uint8)
    if comm.rank == root:
        if unique_id is None or len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            size = None if unique_id is None else len(unique_id)
            raise CollectiveError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got "
                                  f"{size}")
        buf[0] = 1
        buf[1:] = np.frombuffer(unique_id, np.uint8)
    comm.broadcast(SegmentedBuffer([buf]), root)
    if buf[0] != 1:
        raise CollectiveError(f"rank {root} did not send an NCCL unique id")
    return buf[1:].tobytes()


def id_to_tuple(unique_id: bytes) -> tuple[int, ...]:
    """NCCL's id as cupy takes it: 128 C ``char`` values (signed)."""
    return tuple(b - 256 if b > 127 else b for b in unique_id)


def id_from_tuple(values: tuple[int, ...]) -> bytes:
    """cupy's ``get_unique_id()`` tuple as bytes."""
    return bytes(v & 0xFF for v in values)
