"""The MPI engine's response cache: allreduces the ranks already agreed on, by number.

A training loop asks for allreduces of the same shapes and types every step (their
names may change: unnamed calls are numbered). When rank 0's coordinator has validated
an allreduce of all ranks, rank 0 labels each of its tensors with a number for that
kind of request, and every rank remembers its own request under that number. A later
round in which every rank sends the same numbers and names needs no decision by rank 0:
a small tensor that rides along (eager) every rank reduces itself, in rank order, with
the coordinator's arithmetic, so all get the same bits; a lone larger one every rank
runs on the backend at once. Rank 0 hands out the numbers, so they mean the same on
every rank. Several larger tensors still go to rank 0, which fuses them.

A cached message is ``b"C"``, the count and the length of what follows up to the
tensors (numbers, name lengths, names), then the tensors' bytes one after another;
anything else travels pickled (``b"P"`` + pickle).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from array import array
from collections.abc import Sequence

import numpy as np

from hvd_spark.collectives import messages as m
from hvd_spark.collectives.messages import Request, Response
from hvd_spark.collectives.ops import ReduceOp, reduce_rows

CACHED = b"C"
PICKLED = b"P"
_HEAD = struct.Struct("<cxxxIIxxxx")  # 16 bytes: kind, count, bytes of numbers and names
# Numbers handed out at most; past it, new kinds of request always go to rank 0.
CAPACITY = 8192


def cacheable(response: Response) -> bool:
    """Whether ``response`` was a valid allreduce of all ranks (what the cache holds)."""
    return (response.kind == m.ALLREDUCE and not response.error and response.members is None
            and not response.joined)


def signature(request: Request) -> tuple:
    """What a request asks for, but its name and tensor (what the ranks validate)."""
    q = request
    return (q.kind, q.dtype, q.shape, q.op, q.prescale, q.postscale, q.root, q.splits,
            q.members, q.error, q.device, q.layout)


class Labeler:
    """Rank 0: hands out the numbers, one per signature of its own requests.

    Args:
        capacity: Most numbers handed out.
    """

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._numbers: dict[tuple, int] = {}

    def label(self, request: Request) -> int:
        """The number of rank 0's ``request`` (-1: the cache is full)."""
        sig = signature(request)
        number = self._numbers.get(sig)
        if number is None:
            if len(self._numbers) >= self.capacity:
                return -1
            number = self._numbers[sig] = len(self._numbers)
        return number


@dataclasses.dataclass(frozen=True)
class _Known:
    """One number on this rank: its own request's signature, and how to reduce it."""

    signature: tuple
    dtype: np.dtype
    count: int
    op: ReduceOp
    postscale: float
    request: Request  # without its tensor


def _head(numbers: list[int], names: list[str]) -> bytes:
    """A cached message up to its tensors: the ranks compare these bytes."""
    raw = [n.encode() for n in names]
    meta = array("i", numbers + [len(n) for n in raw]).tobytes() + b"".join(raw)
    meta += bytes(-len(meta) % 8)  # the tensors start aligned
    return _HEAD.pack(CACHED, len(numbers), len(meta)) + meta


class ResponseCache:
    """This rank's requests that every rank ran together as eager allreduces, by number."""

    def __init__(self) -> None:
        self._known: dict[int, _Known] = {}
        self._by_signature: dict[tuple, int] = {}
        # (dtype, shape, op, postscale) -> number of such an allreduce, or None when the
        # ranks have not agreed on one (a memo of number_of)
        self._number_by_args: dict[tuple, int | None] = {}
        self._heads: dict[tuple[int, str, bool], bytes] = {}  # see head_one

    def __len__(self) -> int:
        return len(self._known)

    def remember(self, number: int, request: Request) -> None:
        """Record this rank's ``request`` under rank 0's ``number`` (every rank, for each
        tensor of a ``cacheable`` response; -1 does nothing)."""
        if number < 0:
            return
        sig = signature(request)
        old = self._known.get(number)
        if old is not None and old.signature == sig and self._by_signature.get(sig) == number:
            return  # known already (every eager round of an uncached name says it again)
        self._number_by_args.clear()  # numbers move: look them up anew
        if old is not None and self._by_signature.get(old.signature) == number:
            del self._by_signature[old.signature]
        self._known[number] = _Known(sig, np.dtype(request.dtype), math.prod(request.shape),
                                     ReduceOp(request.op), request.postscale,
                                     dataclasses.replace(request, payload=None))
        self._by_signature[sig] = number

    def encode(self, requests: Sequence[Request]) -> bytes | None:
        """The cached message for ``requests``, or None when one of them is of a kind
        not cached, or carries no tensor."""
        numbers = []
        for request in requests:
            number = self._by_signature.get(signature(request))
            if number is None:
                return None
            # The lowest bit says whether the tensor rides along: the ranks compare it too.
            numbers.append(2 * number + (request.payload is not None))
        head = _head(numbers, [q.name for q in requests])
        return b"".join([head, *(q.payload.tobytes() for q in requests if q.payload is not None)])

    def number_of(self, dtype: np.dtype, shape: tuple[int, ...], op: int,
                  postscale: float) -> int | None:
        """The number of this rank's allreduce of ``dtype`` and ``shape`` (no prescale,
        the global process set), or None when the ranks have not agreed on one yet."""
        key = (dtype, shape, op, postscale)
        try:
            return self._number_by_args[key]
        except KeyError:
            pass
        if len(self._number_by_args) >= 4 * CAPACITY:
            self._number_by_args.clear()  # shapes never agreed on (past the cache's capacity)
        probe = Request("", m.ALLREDUCE, dtype.name, shape, int(op), 1.0, float(postscale))
        number = self._number_by_args[key] = self._by_signature.get(signature(probe))
        return number

    def head_one(self, number: int, name: str, riding: bool) -> bytes:
        """What ``encode`` puts before the tensor of a lone allreduce (all of its
        message when the tensor does not ride along)."""
        key = (number, name, riding)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= CAPACITY:
                self._heads.clear()  # unnamed calls: a new name every step
            head = self._heads[key] = _head([2 * number + riding], [name])
        return head

    @staticmethod
    def _parse(part: bytes) -> tuple[list[int], list[str], int]:
        """A cached message's numbers, names, and where its tensors start."""
        _, count, meta = _HEAD.unpack_from(part)
        ints = array("i", part[_HEAD.size : _HEAD.size + 8 * count])
        names, at = [], _HEAD.size + 8 * count
        for length in ints[count:]:
            names.append(part[at : at + length].decode())
            at += length
        return ints[:count].tolist(), names, _HEAD.size + meta

    def agreed(self, parts: Sequence[bytes]) -> tuple[list[int], list[str], int] | None:
        """The numbers and names every rank sent alike (and where the tensors start), or
        None when the ranks' messages differ or one is not cached: then rank 0 decides."""
        first = parts[0]
        if first[:1] != CACHED:
            return None
        head = first[: _HEAD.size + _HEAD.unpack_from(first)[2]]
        if any(part[: len(head)] != head for part in parts[1:]):
            return None
        numbers, names, start = self._parse(first)
        if len(numbers) > 1 and not all(n & 1 for n in numbers):
            return None  # tensors that do not ride along fuse on rank 0's word
        if any(n >> 1 not in self._known for n in numbers):
            return None  # never: every rank remembers the same numbers
        return numbers, names, start

    def reduce(self, agreed: tuple[list[int], list[str], int],
               parts: Sequence[bytes]) -> list[Response]:
        """The eager responses of an agreed round, reduced here from every rank's tensors.

        With ``ops.reduce_rows``, as ``coordinator.eager_result``: each element's
        arithmetic is the same on every rank, so every rank gets the same bits.
        """
        numbers, names, offset = agreed
        out = []
        for number, name in zip(numbers, names):
            if not number & 1:  # run on the backend, as rank 0's answer would say
                out.append(Response(m.ALLREDUCE, (name,)))
                continue
            known = self._known[number >> 1]
            dtype, count = known.dtype, known.count
            total = reduce_rows([np.frombuffer(part, dtype, count, offset) for part in parts],
                                known.op, known.postscale)
            offset += count * dtype.itemsize
            out.append(Response(m.ALLREDUCE, (name,), data=total))
        return out

    def requests(self, part: bytes) -> list[Request]:
        """A rank's cached message as requests (rank 0, when it decides after all).

        This rank's request under a number agreed with the sender's when rank 0 labeled
        them, so it stands in for the sender's (renamed, carrying the sender's tensor).
        """
        numbers, names, offset = self._parse(part)
        out = []
        for number, name in zip(numbers, names):
            known = self._known[number >> 1]
            payload = None
            if number & 1:
                payload = np.frombuffer(part, known.dtype, known.count, offset)
                offset += known.count * known.dtype.itemsize
            out.append(dataclasses.replace(known.request, name=name, payload=payload))
        return out
