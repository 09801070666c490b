"""What ranks tell the coordinator (Request) and what it tells them back (Response)."""

from __future__ import annotations

import dataclasses
import math
import pickle

import numpy as np

ALLREDUCE = "allreduce"
ALLGATHER = "allgather"
BROADCAST = "broadcast"
ALLTOALL = "alltoall"
REDUCESCATTER = "reducescatter"
BARRIER = "barrier"
JOIN = "join"
KINDS = (ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER, JOIN)

#: The one name every rank's ``join()`` uses (only one join can be in flight).
JOIN_NAME = "hvd_spark.join"


_DTYPES: dict[str, np.dtype] = {}


def dtype_of(name: str) -> np.dtype:
    """``np.dtype(name)``, remembered: numpy parses the name anew each time (about a
    microsecond), and every request of every step asks."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = _DTYPES[name] = np.dtype(name)
    return dtype


_NAMES: dict[np.dtype, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, cached: numpy 2 computes it in Python (about 5 us), and every
    request of every step asks for it."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = dtype.name
    return name


#: Most bytes of tensors one control frame carries inside its pickle; the others travel
#: beside it (``wire.encode_obj``). Up to it in-band bytes cost less (a few us); a pickle
#: past 128 KB grows through fresh pages from the kernel (about 100 us each), and a batch
#: of 53 requests with 64 KB tensors took 1 ms to pickle that way.
IN_BAND_MAX_BYTES = 64 * 1024

#: Tensors smaller than this are always pickled as bytes, never offered to travel beside
#: the pickle: cheapest for the lone small allreduce whose latency counts.
OUT_OF_BAND_MIN_BYTES = 4 * 1024


def wire_bytes(array: np.ndarray | bytes | None, protocol: int = 5):
    """How a request's or response's tensor is pickled: raw bytes, or (large) a buffer
    the frame carries beside the pickle."""
    if not isinstance(array, np.ndarray):
        return array
    if protocol >= 5 and array.nbytes >= OUT_OF_BAND_MIN_BYTES and array.flags.c_contiguous:
        # As bytes: numpy exports no buffer of ml_dtypes' types (bfloat16, float8). The
        # frame decides whether it stays in the pickle (``wire.encode_obj``).
        return pickle.PickleBuffer(array.reshape(-1).view(np.uint8))
    return array.tobytes()


# Requests and responses are values: never changed once built. They are not frozen
# dataclasses because a frozen one takes 2-3 us to build and every tensor of every
# step builds several; slots keep them small, and they still hash by value.
@dataclasses.dataclass(unsafe_hash=True, slots=True)
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
        members: Global ranks of the process set it runs in; None for all ranks.
        error: Set when this rank could not submit the operation (its local checks
            failed): the coordinator fails the operation on every rank with it, so the
            ranks' automatic names stay aligned.
        device: Where the tensor lives, "cpu" or "cuda": every rank must agree (the
            bytes take a device path or the host path, never both).
        layout: A grouped allreduce's packed request: every tensor of the group, as
            ``packing.layout_of`` writes it; the ranks must agree (None otherwise).
        payload: A small CPU allreduce's input, flat, sent along with the request so
            rank 0 can reduce it during negotiation (``EngineConfig.eager_bytes``); with
            two ranks that decide alone, also a small broadcast's or allgather's tensor
            (``pairing.pair_payload``); None otherwise. Not part of what ranks must
            agree on.
        lane: On the wire instead of ``payload``: the payload's sequence number on the
            express lane (see ``tcp.express_lane``); None otherwise.
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
    members: tuple[int, ...] | None = None
    error: str | None = None
    device: str = "cpu"
    layout: tuple[int, ...] | None = None
    payload: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    lane: int | None = dataclasses.field(default=None, compare=False, repr=False)

    def __reduce_ex__(self, protocol: int):
        # A plain tuple and raw bytes pickle several times faster than a dataclass
        # holding an ndarray: this goes over the wire with every request.
        return _request, self.fields(protocol)

    def fields(self, protocol: int = 5) -> tuple:
        """The request as a plain tuple (``from_fields`` rebuilds it). The control
        sockets send requests so: pickling one by reference to its rebuilding function
        costs the sender and the receiver about 2.5 us each in looking that function up,
        a tenth of a small synchronous allreduce."""
        return (self.name, self.kind, self.dtype, self.shape, self.op, self.prescale,
                self.postscale, self.root, self.splits, self.members, self.error,
                self.device, self.layout, wire_bytes(self.payload, protocol), self.lane)

    @staticmethod
    def from_fields(fields: tuple) -> Request:
        """The request ``fields`` describes (see ``fields``)."""
        return _request(*fields)

    def with_payload(self, payload: np.ndarray | None, lane: int | None = None) -> Request:
        """This request with another ``payload`` and ``lane``: a new value (built in a
        third of a microsecond, where ``dataclasses.replace`` takes three)."""
        return Request(self.name, self.kind, self.dtype, self.shape, self.op, self.prescale,
                       self.postscale, self.root, self.splits, self.members, self.error,
                       self.device, self.layout, payload, lane)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor on this rank."""
        return math.prod(self.shape) * dtype_of(self.dtype).itemsize


def _request(name, kind, dtype, shape, op, prescale, postscale, root, splits, members, error,
             device, layout, payload, lane=None) -> Request:
    """Unpickle a Request (see ``Request.__reduce__``)."""
    return Request(name, kind, dtype, shape, op, prescale, postscale, root, splits, members,
                   error, device, layout,
                   None if payload is None else np.frombuffer(payload, dtype), lane)


@dataclasses.dataclass(unsafe_hash=True, slots=True)
class Response:
    """What every rank executes, in the same order.

    Attributes:
        kind: One of KINDS.
        names: Tensors covered (several for a fused allreduce).
        error: Set when the ranks disagreed; the named operations fail with it.
        first_dims: Allgather: every rank's first dimension.
        splits: Alltoall: ``splits[src][dst]`` rows sent from src to dst.
        members: Global ranks of the process set that runs it; None for all ranks.
        joined: Ranks that had called ``join()``: they run the allreduce on zeros.
        templates: With ``joined``, the requests the joined ranks build their zeros from.
        result: Join: the last rank to join.
        data: An allreduce reduced during negotiation: the flat result every member
            copies into its output (see ``Request.payload``); raw bytes (or a view of
            the frame it came in) once it has crossed the wire (the members know its
            dtype).
        chunk_bytes: Every rank switches its ring chunk size to this before running the
            response, members or not (the autotuner's choice; None: unchanged). Chunks
            must be cut the same on every rank, so this is how all switch together.
    """

    kind: str
    names: tuple[str, ...]
    error: str | None = None
    first_dims: tuple[int, ...] | None = None
    splits: tuple[tuple[int, ...], ...] | None = None
    members: tuple[int, ...] | None = None
    joined: tuple[int, ...] = ()
    templates: tuple[Request, ...] | None = None
    result: int | None = None
    data: np.ndarray | bytes | None = dataclasses.field(default=None, compare=False,
                                                        repr=False)
    chunk_bytes: int | None = None

    def __reduce_ex__(self, protocol: int):
        # As Request: the result travels as raw bytes (its dtype is the entries').
        return _response, self.fields(protocol)

    def fields(self, protocol: int = 5) -> tuple:
        """The response as a plain tuple, as the control sockets send it (see
        ``Request.fields``); ``from_fields`` rebuilds it."""
        return (self.kind, self.names, self.error, self.first_dims, self.splits,
                self.members, self.joined, self.templates, self.result,
                wire_bytes(self.data, protocol), self.chunk_bytes)

    @staticmethod
    def from_fields(fields: tuple) -> Response:
        """The response ``fields`` describes (see ``fields``)."""
        return _response(*fields)


def _response(kind, names, error, first_dims, splits, members, joined, templates, result,
              data, chunk_bytes=None) -> Response:
    """Unpickle a Response (see ``Response.__reduce__``)."""
    return Response(kind, names, error, first_dims, splits, members, joined, templates, result,
                    data, chunk_bytes)
