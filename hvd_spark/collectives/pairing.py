"""Two ranks decide their small allreduces, broadcasts and allgathers alone, without a
round trip through rank 0.

An eager allreduce (its tensor rides on its request, see ``Request.payload``) needs
nothing but both ranks' requests: validate them as rank 0's coordinator does, reduce the
two tensors in rank order with the coordinator's arithmetic (``ops.reduce_rows``), and
both ranks hold the same bits. With two ranks, rank 1 already sends its requests to rank
0; if rank 0 also sends rank 1 a copy of its own, each rank can decide alone as soon as
it has both: one message each way, crossing, instead of a request, rank 0's work and a
response one after the other: about a third off a small allreduce's latency here.
Small broadcasts and allgathers pair the same way (``pair_output``): the root's tensor,
or both ranks' tensors, ride on the requests, and each rank copies out its result.

Rank 0 stays the authority. It pairs its request only while the coordinator has nothing
to add (no timeline, autotuner, joined or departed rank), and rank 1 decides a name alone
only with rank 0's copy of it in hand. When one rank's request cannot be paired (another
shape, no tensor along), both go through the coordinator as before, and rank 1 drops
rank 0's copy when the coordinator's response for that name runs.
"""

from __future__ import annotations

import math

import numpy as np

from hvd_spark.collectives import messages as m
from hvd_spark.collectives.coordinator import request_problem, validate
from hvd_spark.collectives.messages import Request, Response
from hvd_spark.collectives.ops import ReduceOp, reduce_rows
from hvd_spark.errors import CollectiveError

# The kinds two ranks may decide alone, when their tensors ride on the requests.
_PAIRED_KINDS = (m.ALLREDUCE, m.BROADCAST, m.ALLGATHER)


def pairable(request: Request) -> bool:
    """Whether ``request`` can be decided by the two ranks alone (both ranks ask this of
    rank 1's requests, so it depends on the request only).

    A broadcast's request is pairable when it carries a payload: the root's tensor, or
    an empty one from the other rank (``pair_payload``), which says it is small enough.
    """
    return (request.payload is not None and request.kind in _PAIRED_KINDS
            and request.members is None and request.error is None
            and request.op != ReduceOp.Adasum)


def pair_payload(kind: str, work: np.ndarray, root: int, rank: int) -> np.ndarray:
    """What a small broadcast or allgather's request carries when two ranks pair it:
    the tensor, flat; a broadcast's receiver sends none of it (an empty array of the
    dtype, which still marks the request pairable)."""
    if kind == m.BROADCAST and root != rank:
        return work.reshape(-1)[:0]
    return work.reshape(-1)


def pair_output(first: Request, second: Request, target: np.ndarray) -> np.ndarray:
    """The result of an agreed pair (rank 0's ``first``, rank 1's ``second``, which
    ``disagreement`` passed), computed from their payloads.

    Args:
        target: This rank's working array: an allreduce's output and a broadcast's
            (written in place); an allgather returns a fresh array.
    """
    if first.kind == m.ALLREDUCE:
        reduce_rows([first.payload, second.payload], ReduceOp(first.op), first.postscale,
                    out=target.reshape(-1))
        return target
    return moved_output(first.kind, first.root, first.payload, second.payload,
                        first.shape, second.shape, target)


def moved_output(kind: str, root: int, first: np.ndarray, second: np.ndarray,
                 first_shape: tuple[int, ...], second_shape: tuple[int, ...],
                 target: np.ndarray) -> np.ndarray:
    """A paired broadcast's or allgather's result from rank 0's and rank 1's payloads
    (flat, of the dtype), for ranks whose requests agree.

    Args:
        root: A broadcast's root (0 or 1).
        first_shape, second_shape: The ranks' tensors' shapes (an allgather's blocks).
        target: This rank's working array: a broadcast writes into it; an allgather
            returns a fresh array shaped as ``target`` but for its first dim.

    Raises:
        CollectiveError: A payload is not its whole tensor (the ranks' eager settings
            differ so that one sent none): never bits from nowhere.
    """
    if kind == m.BROADCAST:
        source = second if root else first
        if source.size != target.size:
            raise CollectiveError(
                f"a paired broadcast's root sent {source.size} of {target.size} elements; "
                "set HVD_SPARK_EAGER_BYTES alike on every rank")
        target.reshape(-1)[...] = source  # (the root's own tensor: copied onto itself)
        return target
    rows = first_shape[0] + second_shape[0]
    out = np.empty((rows, *target.shape[1:]), target.dtype)
    split = first.size
    if split != math.prod(first_shape) or second.size != math.prod(second_shape):
        raise CollectiveError("a paired allgather's payload is not its rank's tensor")
    flat = out.reshape(-1)
    flat[:split] = first
    flat[split:] = second
    return out


def disagreement(name: str, first: Request, second: Request) -> Response | None:
    """What rank 0's coordinator would answer for rank 0's ``first`` and rank 1's
    ``second`` when they cannot run (an error response); None when they agree (then
    their tensors have the same shape and dtype: ``ops.reduce_rows`` combines them)."""
    if first == second and first.error is None:  # the usual case: one cached check
        if request_problem(first.kind, first.dtype, first.op, first.prescale,
                           first.postscale, first.root, 2) is None:
            return None
    response = validate(name, {0: first, 1: second}, 2)
    return response if response.error is not None else None


class PairTable:
    """One rank's paired requests waiting for the other rank's, by name.

    ``own`` holds this rank's, ``peer`` the other rank's; each value is the request and
    when it was recorded (``time.monotonic()``), for stall warnings and the timeout. The
    engine uses it under its lock: callers' threads record, the cycle matches.
    """

    def __init__(self) -> None:
        self.own: dict[str, tuple[Request, float]] = {}
        self.peer: dict[str, tuple[Request, float]] = {}
        #: Rank 0: names rank 1 asked for without pairing; the coordinator decides them.
        self.unpaired: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.own or self.peer)

    def matched(self) -> list[tuple[str, Request, Request]]:
        """Remove and return the names both ranks have asked for: (name, own, peer)."""
        if not (self.own and self.peer):
            return []
        names = [n for n in self.own if n in self.peer]
        return [(n, self.own.pop(n)[0], self.peer.pop(n)[0]) for n in names]

    def drop(self, names) -> None:
        """Forget ``names`` (the coordinator answered them)."""
        for name in names:
            self.own.pop(name, None)
            self.peer.pop(name, None)

    def oldest(self) -> float | None:
        """When the longest-waiting request was recorded (None when empty)."""
        times = [t for _, t in self.own.values()] + [t for _, t in self.peer.values()]
        return min(times) if times else None
