"""What ranks tell the coordinator (Request) and what it tells them back (Response)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

ALLREDUCE = "allreduce"
ALLGATHER = "allgather"
BROADCAST = "broadcast"
ALLTOALL = "alltoall"
REDUCESCATTER = "reducescatter"
BARRIER = "barrier"
KINDS = (ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER)


@dataclasses.dataclass(frozen=True)
class Request:
    """One rank's wish to run a named collective on a tensor.

    Attributes:
        name: Name the ranks match on.
        kind: One of KINDS.
        dtype: Numpy dtype name.
        shape: Tensor shape on this rank.
        op: ReduceOp value (reductions only).
        prescale: Factor applied before reducing.
        postscale: Factor applied after reducing.
        root: Root rank (broadcast only).
        splits: Rows sent to each rank (alltoall only).
    """

    name: str
    kind: str
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    op: int = 1
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    splits: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor on this rank."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Response:
    """What every rank executes, in the same order.

    Attributes:
        kind: One of KINDS.
        names: Tensors covered (several for a fused allreduce).
        error: Set when the ranks disagreed; the named operations fail with it.
        first_dims: Allgather: every rank's first dimension.
        splits: Alltoall: ``splits[src][dst]`` rows sent from src to dst.
    """

    kind: str
    names: tuple[str, ...]
    error: str | None = None
    first_dims: tuple[int, ...] | None = None
    splits: tuple[tuple[int, ...], ...] | None = None
