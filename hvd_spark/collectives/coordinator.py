"""The coordinator's bookkeeping, as pure logic: which named operations every rank
has asked for, whether they agree, and how ready allreduces fuse.

Rank 0's engine feeds it requests from all ranks and sends out what it returns.
Ranks are global ranks throughout; an operation in a process set waits only for
that set's members, and ranks that called ``join()`` stand in with zeros.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
from collections.abc import Callable

import numpy as np

from hvd_spark.collectives import messages as m
from hvd_spark.collectives import packing
from hvd_spark.collectives.messages import Request, Response
from hvd_spark.collectives.ops import ReduceOp, check_dtype, check_reduction, reduce_rows
from hvd_spark.config import EngineConfig
from hvd_spark.errors import CollectiveError

log = logging.getLogger(__name__)


# ------------------------------------------------------------ the stall policy (every engine)


def stall_limit(config: EngineConfig) -> float:
    """How long an operation may wait for some ranks before it fails: the collective
    timeout, or HOROVOD_STALL_SHUTDOWN_TIME_SECONDS when set and sooner."""
    limit = config.timeout
    if config.stall_shutdown > 0:
        limit = min(limit, config.stall_shutdown)
    return limit


def warn_stall(name: str, after_s: float, missing: list[int]) -> None:
    """Log that operation ``name`` has waited over ``after_s`` s for ranks ``missing``."""
    log.warning(
        "collective %r has waited over %.0f s for ranks %s; they may be stuck or call "
        "collectives with other names", name, after_s, missing)


def stall_error(name: str, missing: list[int], limit: float) -> str:
    """The error of operation ``name`` that ranks ``missing`` did not submit in ``limit`` s."""
    return (f"collective {name!r}: ranks {missing} did not submit it within {limit} s "
            "(a rank is stuck, or ranks call collectives in different orders/names)")


def _disagreement(name: str, what: str, by_rank: dict[int, object]) -> str:
    values = ", ".join(f"rank {r}: {v}" for r, v in sorted(by_rank.items()))
    return f"ranks disagree on the {what} of collective {name!r} ({values})"


def _error(first: Request, name: str, message: str) -> Response:
    return Response(first.kind, (name,), error=message, members=first.members)


# Kinds whose requests are identical on every rank when all is well.
_SAME_EVERYWHERE = (m.ALLREDUCE, m.BROADCAST, m.BARRIER)


@functools.lru_cache(maxsize=256)
def request_problem(kind: str, dtype: str, op: int, prescale: float, postscale: float,
                     root: int, size: int) -> str | None:
    """Whether a request all ranks agree on is still invalid (None: fine); cached, since
    a training loop asks the same few questions every step."""
    try:
        if kind != m.BARRIER:
            check_dtype(np.dtype(dtype), "")
        if kind == m.ALLREDUCE:
            check_reduction(np.dtype(dtype), ReduceOp(op), prescale, postscale, "")
    except CollectiveError as exc:
        return str(exc)
    if kind == m.BROADCAST and not 0 <= root < size:
        return "root out of range"
    return None


def validate(name: str, requests: dict[int, Request], size: int) -> Response:
    """Check that the ranks' requests for ``name`` agree; return what to execute.

    Args:
        name: The operation's name.
        requests: Global rank -> its request (every member, or every member still
            running when others have joined).
        size: Number of ranks in the operation's process set.
    """
    first = requests[min(requests)]
    if (first.kind in _SAME_EVERYWHERE and first.error is None
            and all(q == first for q in requests.values())):
        # The usual case: every rank asked for the same; only the request itself can be bad.
        problem = request_problem(first.kind, first.dtype, first.op, first.prescale,
                                   first.postscale, first.root, size)
        if problem is None:
            return Response(first.kind, (name,), members=first.members)
    failed = {r: q.error for r, q in requests.items() if q.error}
    if failed:
        reasons = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
        return _error(first, name, f"collective {name!r} failed on some ranks: {reasons}")
    layouts = {r: q.layout for r, q in requests.items()}
    if len(set(layouts.values())) > 1:  # before the dtype: a packed request's differs too
        shown = "; ".join(f"rank {r}: {packing.describe(v)}" for r, v in sorted(layouts.items()))
        values = list(layouts.values())
        if all(packing.same_tensors(values[0], v) for v in values[1:]):
            why = ("the same dtypes and shapes, but not the same kinds of values: a tensor "
                   "that is a numpy array on one rank is another value, or read-only in "
                   "place, on another; pass numpy arrays alike on every rank")
        else:
            why = "every rank must pass the same dtypes and shapes, in the same order"
        return _error(first, name, f"grouped allreduce {name!r}: the ranks passed different "
                      f"groups of tensors ({why}): {shown}")
    for field, what in (("kind", "operation"), ("dtype", "dtype"), ("members", "process set"),
                        ("device", "device (CPU or GPU)")):
        values = {r: getattr(q, field) for r, q in requests.items()}
        if len(set(values.values())) > 1:
            return _error(first, name, _disagreement(name, what, values))
    kind = first.kind
    shapes = {r: q.shape for r, q in requests.items()}
    try:
        if kind not in (m.BARRIER, m.JOIN):
            check_dtype(np.dtype(first.dtype), name)
        if kind in (m.ALLREDUCE, m.REDUCESCATTER):
            check_reduction(
                np.dtype(first.dtype), ReduceOp(first.op), first.prescale, first.postscale, name
            )
    except CollectiveError as exc:
        return _error(first, name, str(exc))
    if kind in (m.ALLREDUCE, m.REDUCESCATTER, m.BROADCAST):
        if len(set(shapes.values())) > 1:
            return _error(first, name, _disagreement(name, "shape", shapes))
    if kind in (m.ALLREDUCE, m.REDUCESCATTER):
        for field, what in (("op", "reduce op"), ("prescale", "prescale_factor"),
                            ("postscale", "postscale_factor")):
            values = {r: getattr(q, field) for r, q in requests.items()}
            if len(set(values.values())) > 1:
                return _error(first, name, _disagreement(name, what, values))
    if kind == m.REDUCESCATTER:
        if first.op == ReduceOp.Adasum:
            return _error(first, name, f"reducescatter {name!r}: Adasum is only for allreduce")
        if not first.shape or first.shape[0] < 1:
            return _error(first, name, f"reducescatter {name!r} needs a tensor of >= 1 row")
    if kind == m.BROADCAST:
        roots = {r: q.root for r, q in requests.items()}
        if len(set(roots.values())) > 1:
            return _error(first, name, _disagreement(name, "root_rank", roots))
        if not 0 <= first.root < size:
            return _error(first, name, f"broadcast {name!r}: root_rank {first.root} is not a "
                          "rank of the operation's process set")
    if kind in (m.ALLGATHER, m.ALLTOALL):
        if any(len(s) == 0 for s in shapes.values()):
            return _error(first, name, f"{kind} {name!r} needs tensors of rank >= 1")
        trailing = {r: s[1:] for r, s in shapes.items()}
        if len(set(trailing.values())) > 1:
            return _error(first, name, _disagreement(name, "shape after dim 0", trailing))
    ranks = sorted(requests)
    if kind == m.ALLGATHER:
        return Response(kind, (name,), first_dims=tuple(shapes[r][0] for r in ranks),
                        members=first.members)
    if kind == m.ALLTOALL:
        return _alltoall_response(name, [requests[r] for r in ranks], first.members)
    return Response(kind, (name,), members=first.members)


def eager_result(group: list[dict[int, Request]]) -> np.ndarray | None:
    """Reduce a (fused) allreduce whose every request carries its tensor (``Request.payload``).

    Args:
        group: Per tensor of the fused operation, in order: every member's request.

    Returns:
        The tensors' results, flat and one after another (every member receives the
        same bits: rank 0 combines the ranks in rank order), or None when some request
        has no usable payload: the ranks then run the allreduce on the backend.
    """
    first = next(iter(group[0].values()))
    op = first.op
    if op == ReduceOp.Adasum:
        return None
    dtype = m.dtype_of(first.dtype)
    ranks = sorted(group[0])
    per_rank: list[list[np.ndarray]] = [[] for _ in ranks]
    for requests in group:
        count = math.prod(next(iter(requests.values())).shape)
        for i, r in enumerate(ranks):
            payload = requests[r].payload
            if payload is None or payload.dtype != dtype or payload.size != count:
                return None
            per_rank[i].append(payload.reshape(-1))
    rows = [parts[0] if len(parts) == 1 else np.concatenate(parts) for parts in per_rank]
    # A lone tensor's row 0 is a payload (rank 0's is the caller's array): never reuse it.
    return reduce_rows(rows, op, first.postscale, reuse_first=len(group) > 1)


def _alltoall_response(name: str, requests: list[Request], members) -> Response:
    size = len(requests)
    matrix = []
    for r, q in enumerate(requests):
        rows = q.shape[0]
        if q.splits is None:
            if rows % size:
                return _error(q, name, (
                    f"alltoall {name!r}: rank {r} has {rows} rows, not divisible by {size} ranks; "
                    "pass splits"))
            splits = (rows // size,) * size
        else:
            splits = q.splits
        if len(splits) != size or sum(splits) != rows or min(splits) < 0:
            return _error(q, name, (
                f"alltoall {name!r}: rank {r}'s splits {list(splits)} must be {size} "
                f"non-negative counts summing to its {rows} rows"))
        matrix.append(tuple(splits))
    return Response(m.ALLTOALL, (name,), splits=tuple(matrix), members=members)


class Coordinator:
    """Collects requests from all ranks and emits responses in a fixed order.

    Args:
        size: Number of ranks.
        fusion_threshold: Most bytes one fused allreduce may cover.
        eager_bytes: A fused allreduce of at most this many bytes whose tensors came with
            their requests is reduced here, and its result sent with the response.
        lone_eager_bytes: The same for an allreduce of one tensor (a synchronous call's
            may ride larger, ``EngineConfig.eager_limit``); default ``eager_bytes``.
    """

    def __init__(self, size: int, fusion_threshold: int, eager_bytes: int = 0,
                 lone_eager_bytes: int | None = None) -> None:
        self.size = size
        self.fusion_threshold = fusion_threshold
        self.eager_bytes = eager_bytes
        self.lone_eager_bytes = eager_bytes if lone_eager_bytes is None else lone_eager_bytes
        # Allreduces whose requests all carry payloads: name -> every rank's request.
        self._eager_inputs: dict[str, dict[int, Request]] = {}
        self._table: dict[str, dict[int, Request]] = {}
        self._first_seen: dict[str, float] = {}
        self._ready: collections.OrderedDict[str, Response] = collections.OrderedDict()
        self._requests: dict[str, Request] = {}
        self.departed: dict[int, str] = {}
        self._warned: set[str] = set()
        #: Ranks that called join(), in the order they did.
        self.joined: list[int] = []
        #: A ring chunk size every rank switches to at the next response sent (autotune).
        self.next_chunk_bytes: int | None = None
        #: Bytes of the tensors the last ``take_responses`` covered (for the autotuner).
        self.taken_bytes = 0

    def _members(self, request: Request) -> tuple[int, ...] | range:
        return request.members if request.members is not None else range(self.size)

    def add(self, rank: int, request: Request, now: float) -> None:
        """Record that ``rank`` asked for ``request``."""
        entry = self._table.setdefault(request.name, {})
        self._first_seen.setdefault(request.name, now)
        if rank in entry:
            self._finish(request.name, _error(request, request.name, (
                f"rank {rank} submitted collective {request.name!r} twice before it completed")))
            return
        entry[rank] = request
        if request.kind == m.JOIN:
            self._on_join(rank)
            return
        self._check(request.name)
        if request.name in self._table and self.departed:
            self._fail_departed(request.name)

    def _check(self, name: str) -> None:
        """Finish ``name`` when every member has asked for it (joined ranks excused)."""
        entry = self._table[name]
        first = entry[min(entry)]
        if first.kind == m.JOIN:
            return
        if first.members is None and not self.joined:
            # The usual case, on every tensor of every step: wait for all ranks.
            if len(entry) >= self.size:
                self._finish(name, validate(name, entry, self.size))
            return
        members = self._members(first)
        standing_in = [] if first.members is not None else [
            r for r in self.joined if r not in entry]
        if any(r not in entry and r not in standing_in for r in members):
            return
        if not standing_in:
            self._finish(name, validate(name, entry, len(members)))
            return
        if first.kind != m.ALLREDUCE:
            self._finish(name, _error(first, name, (
                f"{first.kind} {name!r} cannot run: rank(s) {standing_in} already called join(); "
                "while ranks have joined, only allreduce can run (they contribute zeros)")))
            return
        response = validate(name, entry, len(members))
        if response.error is None:
            # The joined ranks need the shape and dtype, not the tensor riding along.
            response = Response(m.ALLREDUCE, (name,), joined=tuple(standing_in),
                                templates=(dataclasses.replace(first, payload=None),))
        self._finish(name, response)

    def _on_join(self, rank: int) -> None:
        if rank not in self.joined:
            self.joined.append(rank)
        if len(self.joined) == self.size:
            last = self.joined[-1]
            self.joined = []
            self._finish(m.JOIN_NAME, Response(m.JOIN, (m.JOIN_NAME,), result=last))
            return
        for name in [n for n in self._table if n != m.JOIN_NAME]:
            self._check(name)

    def depart(self, rank: int, reason: str) -> None:
        """Mark ``rank`` as gone: everything waiting for it fails with ``reason``."""
        self.departed[rank] = reason
        for name in list(self._table):
            self._fail_departed(name)

    def _fail_departed(self, name: str) -> None:
        entry = self._table[name]
        members = self._members(entry[min(entry)])
        missing = [r for r in self.departed if r not in entry and r in members]
        if missing:
            first = entry[min(entry)]
            reasons = "; ".join(f"rank {r} {self.departed[r]}" for r in missing)
            self._finish(name, Response(first.kind, (name,), members=first.members, error=(
                f"collective {name!r} cannot complete: {reasons}")))

    def _finish(self, name: str, response: Response) -> None:
        entry = self._table.pop(name, {})
        self._first_seen.pop(name, None)
        self._warned.discard(name)
        if entry:
            self._requests[name] = entry[min(entry)]
            if (response.kind == m.ALLREDUCE and response.error is None
                    and not response.joined
                    and all(q.payload is not None for q in entry.values())):
                self._eager_inputs[name] = entry
        self._ready[name] = response

    def waiting_for(self, name: str) -> bool:
        """True when some rank asked for ``name`` and the others have not yet."""
        return name in self._table

    def has_ready(self) -> bool:
        """True when responses are waiting to be sent."""
        return bool(self._ready)

    def quiet(self, name: str, partial_ok: bool) -> bool:
        """True when no response waits to be sent, no rank asked for ``name``, and no
        operation is partly submitted unless ``partial_ok`` (the express path's check:
        one call where ``waiting_for``, ``has_ready`` and ``has_partial`` are three)."""
        table = self._table
        if self._ready or name in table:
            return False
        return not table or partial_ok or not self.has_partial()

    def has_partial(self) -> bool:
        """True when some operation is submitted by some ranks but not yet all.

        Then more tensors are likely to become ready within moments, and waiting a
        cycle lets them join the same fused operation. A pending join does not count.
        """
        return any(n != m.JOIN_NAME for n in self._table)

    def take_responses(self) -> list[Response]:
        """Return the ready responses, allreduces fused by dtype/op/scale up to the threshold.

        A fused allreduce small enough (``eager_bytes``) whose tensors all came with
        their requests is reduced here: its response carries the result.
        """
        # Per response to send: [the response, names fused into it (None: just its
        # own), bytes of a fusible allreduce (0 for the rest)].
        groups: list[list] = []
        open_groups: dict[tuple, int] = {}  # key -> index in groups
        taken = 0
        threshold = self.fusion_threshold
        for name, response in self._ready.items():
            request = self._requests.pop(name, None)
            nbytes = request.nbytes if request is not None else 0
            taken += nbytes
            if (response.kind != m.ALLREDUCE or response.error or request is None
                    or response.joined or request.op == ReduceOp.Adasum):
                groups.append([response, None, 0])
                continue
            key = (request.dtype, request.device, request.op, request.prescale, request.postscale,
                   request.members)
            index = open_groups.get(key)
            group = groups[index] if index is not None else None
            if group is not None and group[2] + nbytes <= threshold:
                if group[1] is None:
                    group[1] = list(group[0].names)
                group[1].append(name)  # the fused response is built once, below
                group[2] += nbytes
            else:
                open_groups[key] = len(groups)
                groups.append([response, None, nbytes])
        self._ready.clear()
        self.taken_bytes = taken
        eager, self._eager_inputs = self._eager_inputs, {}
        out: list[Response] = []
        for response, fused, nbytes in groups:
            names = response.names if fused is None else tuple(fused)
            # Fused tensors ride only up to the usual limit: in the ring they cost less.
            limit = self.lone_eager_bytes if len(names) == 1 else self.eager_bytes
            if (eager and response.kind == m.ALLREDUCE and nbytes <= limit
                    and not response.error and all(n in eager for n in names)):
                data = eager_result([eager[n] for n in names])
                if data is not None:
                    out.append(Response(m.ALLREDUCE, names, members=response.members, data=data))
                    continue
            if fused is not None:
                response = Response(m.ALLREDUCE, names, members=response.members)
            out.append(response)
        if out and self.next_chunk_bytes is not None:
            out[0] = dataclasses.replace(out[0], chunk_bytes=self.next_chunk_bytes)
            self.next_chunk_bytes = None
        return out

    def stalled(self, now: float, older_than: float) -> list[tuple[str, list[int]]]:
        """Operations waiting longer than ``older_than`` s, with the ranks not yet there.

        Each is reported once. A pending join is not a stall: ranks join when their data ends.
        """
        out = []
        for name, since in self._first_seen.items():
            if name == m.JOIN_NAME:
                continue
            if now - since > older_than and name not in self._warned:
                self._warned.add(name)
                out.append((name, self._missing(name)))
        return out

    def _missing(self, name: str) -> list[int]:
        entry = self._table[name]
        return [r for r in self._members(entry[min(entry)]) if r not in entry]

    def police_stalls(self, now: float, config: EngineConfig,
                      before_expiry: Callable[[float], None] | None = None) -> None:
        """The stall policy: warn once of each operation waiting over
        ``config.stall_warning`` s for some ranks, then fail those past ``stall_limit``.

        Args:
            now: ``time.monotonic()``.
            config: The engine's settings (stall warning, stall shutdown, timeout).
            before_expiry: Called with the limit between the two (the TCP engine hands
                over its paired requests that waited too long, to expire with the rest).
        """
        for name, missing in self.stalled(now, config.stall_warning):
            warn_stall(name, config.stall_warning, missing)
        limit = stall_limit(config)
        if before_expiry is not None:
            before_expiry(limit)
        self.expire(now, limit)

    def expire(self, now: float, timeout: float) -> None:
        """Fail operations some ranks have not joined within ``timeout`` s."""
        for name, since in list(self._first_seen.items()):
            if name == m.JOIN_NAME:
                continue
            if now - since > timeout:
                missing = self._missing(name)
                first = next(iter(self._table[name].values()))
                self._finish(name, Response(first.kind, (name,), members=first.members,
                                            error=stall_error(name, missing, timeout)))
