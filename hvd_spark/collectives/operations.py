"""How each negotiated collective runs on a backend once every rank agreed on it.

An ``Entry`` is one rank's half of an operation: its request, its handle, the
contiguous array the backend works on, and what turns that array into the result.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hvd_spark.collectives import adasum, ops
from hvd_spark.collectives import messages as m
from hvd_spark.collectives.buffers import OUTPUTS, SegmentedBuffer, even_counts
from hvd_spark.collectives.communicator import Communicator
from hvd_spark.collectives.messages import Request, Response
from hvd_spark.errors import CollectiveError, CollectiveTimeoutError

# Tensors below this many bytes are packed into one buffer when fused: one numpy
# call per tiny tensor per ring chunk would cost more than the copy.
_PACK_BELOW_BYTES = 64 * 1024


class Handle:
    """The pending result of an asynchronous collective.

    Completion is a plain lock released once (not a ``threading.Event``, whose
    condition variable costs several microseconds per set on every operation).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._pending = threading.Lock()
        self._pending.acquire()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the operation finished (successfully or not)."""
        return self._done

    @property
    def error(self) -> BaseException | None:
        """The error it finished with (None while running, or when it succeeded)."""
        return self._error

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._pending.release()
        except RuntimeError:
            pass  # completed twice at once (a failure racing a result): the first won

    def set_result(self, result: Any) -> None:
        """Complete with a result (engine side)."""
        self._result = result
        self._finish()

    def set_error(self, error: BaseException) -> None:
        """Complete with an error (engine side)."""
        self._error = error
        self._finish()

    def wait_done(self, timeout: float) -> bool:
        """Block until done, at most ``timeout`` s; True when done (never raises)."""
        if self._done:
            return True
        if self._pending.acquire(timeout=max(0.0, timeout)):
            self._pending.release()  # let every other waiter through too
        return self._done

    def wait(self, timeout: float, waited: float | None = None) -> Any:
        """Block until done, at most ``timeout`` s; return the result or raise its error.

        ``waited``: the caller's whole wait so far, for the timeout's message (else
        ``timeout``)."""
        if not self.wait_done(timeout):
            raise CollectiveTimeoutError(
                f"collective {self.name!r} did not complete within "
                f"{timeout if waited is None else round(waited, 1)} s; some rank may "
                "not have called it (check names and call order), or raise HVD_SPARK_TIMEOUT"
            )
        if self._error is not None:
            raise self._error
        return self._result


@dataclasses.dataclass(eq=False)
class Entry:
    """One rank's part of a collective.

    Attributes:
        request: What this rank asked for.
        handle: Completed when the operation finishes.
        array: Contiguous array the backend reads and writes.
        finish: Turns the final working array into the handle's result.
        submitted: ``time.monotonic()`` at submission.
        source: For an out-of-place allreduce, the caller's input (contiguous, shaped
            as ``array``); ``array`` is then uninitialised output that the backend fills.
        parts: More flat arrays the backend reduces after ``array``, as if one array
            with it (a grouped allreduce's large tensors, uncopied: see ``packing``).
        part_sources: Out of place, the inputs of ``parts`` (parallel to them); the
            parts are then uninitialised output.
    """

    request: Request
    handle: Handle
    array: np.ndarray
    finish: Callable[[np.ndarray], Any] = lambda a: a
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    source: np.ndarray | None = None
    parts: list[np.ndarray] = dataclasses.field(default_factory=list)
    part_sources: list[np.ndarray] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the backend reduces for this entry (``array`` and ``parts``)."""
        return self.array.nbytes + sum(p.nbytes for p in self.parts)

    def pieces(self) -> list[np.ndarray]:
        """The flat arrays the backend writes, in order."""
        return [self.array.reshape(-1), *self.parts]

    def inputs(self) -> list[np.ndarray]:
        """The flat arrays the backend reads first, parallel to ``pieces``."""
        head = (self.source if self.source is not None else self.array).reshape(-1)
        return [head, *(self.part_sources if self.part_sources is not None else self.parts)]

    def reads_input(self) -> bool:
        """Whether the input lies apart from the output (out of place)."""
        return self.source is not None or self.part_sources is not None

    def materialize(self) -> None:
        """Copy the inputs into the outputs (for paths that reduce in place)."""
        if self.source is not None:
            np.copyto(self.array, self.source)
            self.source = None
        if self.part_sources is not None:
            for part, source in zip(self.parts, self.part_sources):
                np.copyto(part, source)
            self.part_sources = None


def _finish_reduction(arr: np.ndarray, request: Request, size: int) -> None:
    ops.finish_reduction(arr, ops.ReduceOp(request.op), request.postscale, size)


def run_adasum(comm: Communicator, entry: Entry) -> Any:
    """Adasum of one tensor: gather every rank's, combine them in the same tree everywhere."""
    flat = entry.array.reshape(-1)
    gathered = np.empty(flat.size * comm.size, flat.dtype)
    gathered[comm.rank * flat.size : (comm.rank + 1) * flat.size] = flat
    comm.allgather(SegmentedBuffer([gathered]), [flat.size] * comm.size)
    parts = [gathered[r * flat.size : (r + 1) * flat.size] for r in range(comm.size)]
    flat[...] = adasum.tree_reduce(parts).astype(flat.dtype)
    ops.scale_in_place(entry.array, entry.request.postscale)
    return entry.finish(entry.array)


def _no_trace(activity: str) -> None:
    del activity


def run_allreduce(comm: Communicator, entries: list[Entry],
                  trace: Callable[[str], None] = _no_trace) -> list[Any]:
    """One (possibly fused) allreduce over all entries' arrays, in place.

    ``trace(activity)`` marks the start of each phase (for the timeline).
    """
    reads_source = comm.reads_source and any(e.reads_input() for e in entries)
    if entries[0].request.op == ops.ReduceOp.Adasum or not reads_source:
        for e in entries:
            e.materialize()
    if entries[0].request.op == ops.ReduceOp.Adasum:
        trace("ADASUM_ALLREDUCE")
        return [run_adasum(comm, e) for e in entries]

    small = [e for e in entries if e.nbytes < _PACK_BELOW_BYTES]
    packed = None
    pieces: list[np.ndarray] = []
    inputs: list[np.ndarray] = []
    for e in entries:
        if e.nbytes >= _PACK_BELOW_BYTES:
            pieces += e.pieces()
            inputs += e.inputs()
    if len(small) > 1:
        trace("MEMCPY_IN_FUSION_BUFFER")
        packed = np.concatenate([e.inputs()[0] for e in small])
        pieces.append(packed)
        inputs.append(packed)
    else:
        for e in small:
            pieces += e.pieces()
            inputs += e.inputs()
    trace("RING_ALLREDUCE")
    first = entries[0].request
    op = ops.ReduceOp(first.op)
    kwargs: dict[str, Any] = {}
    if reads_source:
        kwargs["source"] = SegmentedBuffer(inputs)
    # Fused entries share op and postscale (the coordinator fuses by them), so one
    # finishing function serves every segment.
    finished = comm.finishes_segments and (op == ops.ReduceOp.Average or first.postscale != 1.0)
    if finished:
        def finish(views: list[np.ndarray]) -> None:
            for view in views:
                ops.finish_reduction(view, op, first.postscale, comm.size)

        kwargs["finish"] = finish
    comm.allreduce(SegmentedBuffer(pieces), op, **kwargs)
    trace("MEMCPY_OUT_FUSION_BUFFER")
    if packed is not None:
        offset = 0
        for e in small:
            flat = e.array.reshape(-1)
            flat[...] = packed[offset : offset + flat.size]
            offset += flat.size
    results = []
    for e in entries:
        if not finished:
            for piece in e.pieces():
                _finish_reduction(piece, e.request, comm.size)
        results.append(e.finish(e.array))
    return results


def _output_like(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A fresh output of ``array``'s dtype: pooled for host arrays, and made on the
    device for a device array (``empty_like`` dispatches to cupy)."""
    if type(array) is np.ndarray:
        return OUTPUTS.empty(shape, array.dtype)
    return np.empty_like(array, shape=shape)


def run_allgather(comm: Communicator, entry: Entry, response: Response) -> Any:
    """Concatenate every rank's tensor along dim 0 (first dims may differ)."""
    first_dims = response.first_dims or ()
    row = math.prod(entry.array.shape[1:])
    out = _output_like(entry.array, (sum(first_dims),) + entry.array.shape[1:])
    counts = [d * row for d in first_dims]
    start = sum(counts[: comm.rank])
    flat = out.reshape(-1)
    flat[start : start + counts[comm.rank]] = entry.array.reshape(-1)
    comm.allgather(SegmentedBuffer([flat]), counts)
    return entry.finish(out)


def run_broadcast(comm: Communicator, entry: Entry) -> Any:
    """Overwrite the working array with the root's."""
    comm.broadcast(SegmentedBuffer.of(entry.array), entry.request.root)
    return entry.finish(entry.array)


def run_alltoall(comm: Communicator, entry: Entry, response: Response) -> Any:
    """Exchange row blocks; the result is ``(tensor, received_splits)``."""
    splits = response.splits or ()
    row = math.prod(entry.array.shape[1:])
    send_counts = [s * row for s in splits[comm.rank]]
    recv_rows = [splits[src][comm.rank] for src in range(comm.size)]
    out = _output_like(entry.array, (sum(recv_rows),) + entry.array.shape[1:])
    comm.alltoall(
        entry.array.reshape(-1), send_counts, out.reshape(-1), [r * row for r in recv_rows]
    )
    return entry.finish(out), np.asarray(recv_rows, dtype=np.int64)


def reducescatter_rows(rows: int, size: int) -> list[int]:
    """Rows each rank receives from reducescatter: even, the first ranks take the extra."""
    return even_counts(rows, size)


def run_reducescatter(comm: Communicator, entry: Entry) -> Any:
    """Reduce, then keep this rank's block of rows."""
    arr = entry.array
    row = math.prod(arr.shape[1:])
    rows = reducescatter_rows(arr.shape[0], comm.size)
    counts = [r * row for r in rows]
    comm.reducescatter(SegmentedBuffer.of(arr), ops.ReduceOp(entry.request.op), counts)
    start = sum(rows[: comm.rank])
    mine = arr[start : start + rows[comm.rank]].copy()
    _finish_reduction(mine, entry.request, comm.size)
    return entry.finish(mine)


def execute(comm: Communicator, response: Response, entries: list[Entry],
            trace: Callable[[str], None] | None = None) -> list[Any]:
    """Run one agreed response; return one result per entry, in order.

    Args:
        trace: Called with each phase's name as it starts (the timeline), or None.
    """
    kind = response.kind
    if kind == m.ALLREDUCE:
        return run_allreduce(comm, entries, trace or _no_trace)
    if kind == m.BARRIER:
        return [None]
    (entry,) = entries
    if kind == m.ALLGATHER:
        return [run_allgather(comm, entry, response)]
    if kind == m.BROADCAST:
        return [run_broadcast(comm, entry)]
    if kind == m.ALLTOALL:
        return [run_alltoall(comm, entry, response)]
    if kind == m.REDUCESCATTER:
        return [run_reducescatter(comm, entry)]
    raise CollectiveError(f"unknown collective kind {kind!r}")
