"""Two ranks decide their small allreduces alone, without a round trip through rank 0.

An eager allreduce (its tensor rides on its request, see ``Request.payload``) needs
nothing but both ranks' requests: validate them as rank 0's coordinator does, reduce the
two tensors in rank order with the coordinator's arithmetic (``ops.reduce_rows``), and
both ranks hold the same bits. With two ranks, rank 1 already sends its requests to rank
0; if rank 0 also sends rank 1 a copy of its own, each rank can decide alone as soon as
it has both: one message each way, crossing, instead of a request, rank 0's work and a
response one after the other: about a third off a small allreduce's latency here.

Rank 0 stays the authority. It pairs its request only while the coordinator has nothing
to add (no timeline, autotuner, joined or departed rank), and rank 1 decides a name alone
only with rank 0's copy of it in hand. When one rank's request cannot be paired (another
shape, no tensor along), both go through the coordinator as before, and rank 1 drops
rank 0's copy when the coordinator's response for that name runs.
"""

from __future__ import annotations

from hvd_spark.collectives import messages as m
from hvd_spark.collectives.coordinator import request_problem, validate
from hvd_spark.collectives.messages import Request, Response
from hvd_spark.collectives.ops import ReduceOp


def pairable(request: Request) -> bool:
    """Whether ``request`` can be decided by the two ranks alone (both ranks ask this of
    rank 1's requests, so it depends on the request only)."""
    return (request.kind == m.ALLREDUCE and request.payload is not None
            and request.members is None and request.error is None
            and request.op != ReduceOp.Adasum)


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
