"""The coordinator's bookkeeping, as pure logic: which named operations every rank
has asked for, whether they agree, and how ready allreduces fuse.

Rank 0's engine feeds it requests from all ranks and sends out what it returns.
"""

from __future__ import annotations

import collections

import numpy as np

from hvd_spark.collectives import messages as m
from hvd_spark.collectives.messages import Request, Response
from hvd_spark.collectives.ops import ReduceOp, check_dtype, check_reduction
from hvd_spark.errors import CollectiveError


def _disagreement(name: str, what: str, by_rank: dict[int, object]) -> str:
    values = ", ".join(f"rank {r}: {v}" for r, v in sorted(by_rank.items()))
    return f"ranks disagree on the {what} of collective {name!r} ({values})"


def validate(name: str, requests: dict[int, Request], size: int) -> Response:
    """Check that all ranks' requests for ``name`` agree; return what to execute."""
    first = requests[min(requests)]
    for field, what in (("kind", "operation"), ("dtype", "dtype")):
        values = {r: getattr(q, field) for r, q in requests.items()}
        if len(set(values.values())) > 1:
            return Response(first.kind, (name,), error=_disagreement(name, what, values))
    kind = first.kind
    shapes = {r: q.shape for r, q in requests.items()}
    try:
        if kind != m.BARRIER:
            check_dtype(np.dtype(first.dtype), name)
        if kind in (m.ALLREDUCE, m.REDUCESCATTER):
            check_reduction(
                np.dtype(first.dtype), ReduceOp(first.op), first.prescale, first.postscale, name
            )
    except CollectiveError as exc:
        return Response(kind, (name,), error=str(exc))
    if kind in (m.ALLREDUCE, m.REDUCESCATTER, m.BROADCAST):
        if len(set(shapes.values())) > 1:
            return Response(kind, (name,), error=_disagreement(name, "shape", shapes))
    if kind in (m.ALLREDUCE, m.REDUCESCATTER):
        for field, what in (("op", "reduce op"), ("prescale", "prescale_factor"),
                            ("postscale", "postscale_factor")):
            values = {r: getattr(q, field) for r, q in requests.items()}
            if len(set(values.values())) > 1:
                return Response(kind, (name,), error=_disagreement(name, what, values))
    if kind == m.REDUCESCATTER and (not first.shape or first.shape[0] < 1):
        return Response(kind, (name,), error=f"reducescatter {name!r} needs a tensor of >= 1 row")
    if kind == m.BROADCAST:
        roots = {r: q.root for r, q in requests.items()}
        if len(set(roots.values())) > 1:
            return Response(kind, (name,), error=_disagreement(name, "root_rank", roots))
        if not 0 <= first.root < size:
            return Response(kind, (name,), error=f"broadcast {name!r}: root_rank "
                            f"{first.root} is outside 0..{size - 1}")
    if kind in (m.ALLGATHER, m.ALLTOALL):
        if any(len(s) == 0 for s in shapes.values()):
            return Response(kind, (name,), error=f"{kind} {name!r} needs tensors of rank >= 1")
        trailing = {r: s[1:] for r, s in shapes.items()}
        if len(set(trailing.values())) > 1:
            return Response(kind, (name,), error=_disagreement(name, "shape after dim 0", trailing))
    if kind == m.ALLGATHER:
        return Response(kind, (name,), first_dims=tuple(shapes[r][0] for r in range(size)))
    if kind == m.ALLTOALL:
        return _alltoall_response(name, requests, size)
    return Response(kind, (name,))


def _alltoall_response(name: str, requests: dict[int, Request], size: int) -> Response:
    matrix = []
    for r in range(size):
        q = requests[r]
        rows = q.shape[0]
        if q.splits is None:
            if rows % size:
                return Response(m.ALLTOALL, (name,), error=(
                    f"alltoall {name!r}: rank {r} has {rows} rows, not divisible by {size} ranks; "
                    "pass splits"))
            splits = (rows // size,) * size
        else:
            splits = q.splits
        if len(splits) != size or sum(splits) != rows or min(splits) < 0:
            return Response(m.ALLTOALL, (name,), error=(
                f"alltoall {name!r}: rank {r}'s splits {list(splits)} must be {size} "
                f"non-negative counts summing to its {rows} rows"))
        matrix.append(tuple(splits))
    return Response(m.ALLTOALL, (name,), splits=tuple(matrix))


class Coordinator:
    """Collects requests from all ranks and emits responses in a fixed order.

    Args:
        size: Number of ranks.
        fusion_threshold: Most bytes one fused allreduce may cover.
    """

    def __init__(self, size: int, fusion_threshold: int) -> None:
        self.size = size
        self.fusion_threshold = fusion_threshold
        self._table: dict[str, dict[int, Request]] = {}
        self._first_seen: dict[str, float] = {}
        self._ready: collections.OrderedDict[str, Response] = collections.OrderedDict()
        self._requests: dict[str, Request] = {}
        self.departed: dict[int, str] = {}
        self._warned: set[str] = set()

    def add(self, rank: int, request: Request, now: float) -> None:
        """Record that ``rank`` asked for ``request``."""
        entry = self._table.setdefault(request.name, {})
        self._first_seen.setdefault(request.name, now)
        if rank in entry:
            self._finish(request.name, Response(request.kind, (request.name,), error=(
                f"rank {rank} submitted collective {request.name!r} twice before it completed")))
            return
        entry[rank] = request
        if len(entry) == self.size:
            self._finish(request.name, validate(request.name, entry, self.size))
        elif self.departed:
            self._fail_departed(request.name)

    def depart(self, rank: int, reason: str) -> None:
        """Mark ``rank`` as gone: everything waiting for it fails with ``reason``."""
        self.departed[rank] = reason
        for name in list(self._table):
            self._fail_departed(name)

    def _fail_departed(self, name: str) -> None:
        missing = [r for r in self.departed if r not in self._table[name]]
        if missing:
            kind = next(iter(self._table[name].values())).kind
            reasons = "; ".join(f"rank {r} {self.departed[r]}" for r in missing)
            self._finish(name, Response(kind, (name,), error=(
                f"collective {name!r} cannot complete: {reasons}")))

    def _finish(self, name: str, response: Response) -> None:
        entry = self._table.pop(name, {})
        self._first_seen.pop(name, None)
        self._warned.discard(name)
        if entry:
            self._requests[name] = entry[min(entry)]
        self._ready[name] = response

    def has_ready(self) -> bool:
        """True when responses are waiting to be sent."""
        return bool(self._ready)

    def has_partial(self) -> bool:
        """True when some operation is submitted by some ranks but not yet all.

        Then more tensors are likely to become ready within moments, and waiting a
        cycle lets them join the same fused operation.
        """
        return bool(self._table)

    def take_responses(self) -> list[Response]:
        """Return the ready responses, allreduces fused by dtype/op/scale up to the threshold."""
        out: list[Response] = []
        open_groups: dict[tuple, tuple[int, int]] = {}  # key -> (index in out, bytes so far)
        for name, response in self._ready.items():
            request = self._requests.pop(name, None)
            if response.kind != m.ALLREDUCE or response.error or request is None:
                out.append(response)
                continue
            key = (request.dtype, request.op, request.prescale, request.postscale)
            nbytes = request.nbytes
            slot = open_groups.get(key)
            if slot is not None and slot[1] + nbytes <= self.fusion_threshold:
                index, total = slot
                out[index] = Response(m.ALLREDUCE, out[index].names + (name,))
                open_groups[key] = (index, total + nbytes)
            else:
                open_groups[key] = (len(out), nbytes)
                out.append(response)
        self._ready.clear()
        return out

    def stalled(self, now: float, older_than: float) -> list[tuple[str, list[int]]]:
        """Operations waiting longer than ``older_than`` s, with the ranks not yet there.

        Each is reported once.
        """
        out = []
        for name, since in self._first_seen.items():
            if now - since > older_than and name not in self._warned:
                self._warned.add(name)
                missing = [r for r in range(self.size) if r not in self._table[name]]
                out.append((name, missing))
        return out

    def expire(self, now: float, timeout: float) -> None:
        """Fail operations some ranks have not joined within ``timeout`` s."""
        for name, since in list(self._first_seen.items()):
            if now - since > timeout:
                missing = [r for r in range(self.size) if r not in self._table[name]]
                kind = next(iter(self._table[name].values())).kind
                self._finish(name, Response(kind, (name,), error=(
                    f"collective {name!r}: ranks {missing} did not submit it within {timeout} s "
                    "(a rank is stuck, or ranks call collectives in different orders/names)")))
