"""A grouped allreduce sends its small tensors packed into one array.

Every tensor of an operation costs its own request, validation, decision and completion
(about 40 us on a 2-core host), far more than reducing a tensor of a few kilobytes. The
ResNet-50 gradient set has 109 tensors under 64 KB (0.27 MB in all) beside 52 larger
ones, so a grouped allreduce of it spent about a third more than one flat buffer of the
same bytes. Its small tensors of the group's most common dtype now travel as one array
(copied in, reduced element-wise like each of them alone, copied out); the others go
one by one as before, still fused by the engine.

Ranks must pack alike, and they decide from their own tensors. So every grouped allreduce
(but Adasum's, which is not element-wise) sends the packed request, empty or not, and it
carries the layout of the whole group (which tensors it packs, every tensor's dtype and
shape, ``Request.layout``): groups that differ between ranks fail at once with one error
that shows both. After that error each rank fails the names of the tensors it packed on
every rank (``report``), so a tensor that another rank sent on its own fails too instead
of waiting for a partner that never comes.

In place, the packed result is written back into the caller's arrays when the packed
request completes (its ``finish``), as for any in-place allreduce.

The group's large tensors of the packed dtype ride on the packed request too, uncopied
(``uncopied``): the backend reduces them where they lie, one after another behind the
packed array (``Entry.parts``), in place or into fresh outputs. Every tensor sent alone
cost its own request, validation and decision again (about 30 us each on a 2-core host:
1.6 ms of the ResNet-50 set's 46 large tensors before the ring could start).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hvd_spark.collectives.operations import Handle
from hvd_spark.collectives.ops import SUPPORTED_DTYPES, ReduceOp, array_of

# After a packed request failed, how long a rank waits for the names it reported, and for
# its tensors sent alone, to end (they do within milliseconds when every rank has them).
SETTLE_S = 2.0
# Tensors below this many bytes are packed (the size below which the ring also packs
# fused tensors: past it, copying costs more than a tensor's own request).
PACK_BELOW_BYTES = 64 * 1024

_CODES = {dtype: code for code, dtype in enumerate(sorted(SUPPORTED_DTYPES, key=str))}
_NAMES = {code: str(dtype) for dtype, code in _CODES.items()}
_OTHER = -1  # not a supported array: its own checks fail it


def layout_of(arrays: Sequence[Any], members: Sequence[int] = ()) -> tuple[int, ...]:
    """The group as the ranks must agree on it, flat: which tensors travel packed
    (``len(members), *members``), then every tensor's ``(dtype code, ndim, *shape)``.

    The members are part of it because each rank decides them from its own values (a
    scalar or a read-only array is not packed, an array of the same dtype and shape is):
    two ranks packing different tensors of equal size must fail, not mix them.
    """
    out: list[int] = [len(members), *members]
    for value in arrays:
        arr = array_of(value)
        code = _OTHER if arr is None else _CODES.get(arr.dtype, _OTHER)
        shape = () if arr is None or code == _OTHER else arr.shape
        out += [code, len(shape), *shape]
    return tuple(out)


def same_tensors(first: tuple[int, ...] | None, second: tuple[int, ...] | None) -> bool:
    """Whether two layouts list the same dtypes and shapes (they may still pack others)."""
    if first is None or second is None:
        return first == second
    return first[1 + first[0]:] == second[1 + second[0]:]


def describe(layout: tuple[int, ...] | None, limit: int = 6) -> str:
    """A layout as ``"3 tensors: float32[4, 2], float16[7], ...; packed: [0, 1]"`` for an
    error message."""
    if layout is None:
        return "no layout"
    packed = list(layout[1 : 1 + layout[0]])
    items, at = [], 1 + layout[0]
    while at < len(layout):
        code, ndim = layout[at], layout[at + 1]
        shape = list(layout[at + 2 : at + 2 + ndim])
        items.append(f"{_NAMES.get(code, 'unsupported')}{shape}")
        at += 2 + ndim
    shown = ", ".join(items[:limit]) + (", ..." if len(items) > limit else "")
    return f"{len(items)} tensors: {shown}" + (f"; packed: {packed}" if packed else "")


def packable(value: Any, inplace: bool) -> np.ndarray | None:
    """``value`` as an array when it may be packed (a small numpy array; one an in-place
    call can write back into), else None."""
    arr = value if type(value) is np.ndarray else None
    if (arr is None or arr.dtype not in _CODES or arr.nbytes >= PACK_BELOW_BYTES
            or (inplace and not arr.flags.writeable)):
        return None
    return arr


def plan(arrays: Sequence[Any], op: Any, inplace: bool) -> list[int] | None:
    """Which tensors of a grouped allreduce travel packed (None: the group is not packed
    at all, so no packed request is sent).

    The small tensors of the most common dtype among them (the first such dtype on a tie);
    the same on every rank whose group has the same layout.
    """
    if op == ReduceOp.Adasum:
        return None
    small = [(i, arr.dtype) for i, value in enumerate(arrays)
             if (arr := packable(value, inplace)) is not None]
    if not small:
        return []
    dtype = _most_common([d for _, d in small])
    return [i for i, d in small if d == dtype]


def _most_common(dtypes: list[Any]) -> Any:
    """The most common of ``dtypes`` (the first on a tie: the same on every rank)."""
    counts = collections.Counter(dtypes)
    best = max(counts.values())
    return next(d for d in dtypes if counts[d] == best)


def uncopied(arrays: Sequence[Any], packed: list[int], prescale: float) -> list[int]:
    """Which large tensors of a grouped allreduce join its packed request uncopied.

    Numpy arrays (subclasses too: a memmap) of ``PACK_BELOW_BYTES`` or more of the packed
    tensors' dtype (of the most common such dtype when none is packed): what the layout
    shows, so ranks whose layouts agree choose alike (a rank's non-contiguous array travels
    in a contiguous copy, see ``api``). None when a prescale would scale the caller's data
    before sending: they then go alone, scaled in copies.
    """
    if prescale != 1.0:
        return []
    large = [(i, value.dtype) for i, value in enumerate(arrays)
             if isinstance(value, np.ndarray) and value.dtype in _CODES
             and value.nbytes >= PACK_BELOW_BYTES]
    if not large:
        return []
    dtype = arrays[packed[0]].dtype if packed else _most_common([d for _, d in large])
    return [i for i, d in large if d == dtype]


def slots_of(arrays: Sequence[Any], members: list[int]) -> dict[int, tuple[int, int]]:
    """Where each member lies in the packed array: ``{index: (offset, size)}``."""
    slots, offset = {}, 0
    for i in members:
        size = int(np.asarray(arrays[i]).size)
        slots[i] = (offset, size)
        offset += size
    return slots


def scatter(packed: np.ndarray, arrays: Sequence[np.ndarray], members: list[int]) -> None:
    """Write the reduced ``packed`` array back into the members' own arrays (in place)."""
    for i, (offset, size) in slots_of(arrays, members).items():
        arrays[i][...] = packed[offset : offset + size].reshape(arrays[i].shape)


def gather(arrays: Sequence[np.ndarray], members: list[int],
           dtype: Any = np.float32) -> np.ndarray:
    """The packed array: the members' elements one after another (``dtype`` when empty)."""
    if not members:
        return np.empty(0, dtype)
    return np.concatenate([np.asarray(arrays[i]).reshape(-1) for i in members])


class Pack:
    """One grouped allreduce's packed request: its handle and where each member lies.

    Args:
        handle: The packed allreduce's handle (its result is the packed array reduced).
        arrays: The group's arrays, as the caller passed them.
        members: Indices of the packed ones, in packing order.
        inplace: Whether results go back into the caller's arrays.
        report: Called with the names of the packed tensors when the packed request fails
            (fails them on every rank, see the module docstring); returns the reports'
            handles.
        names: Every tensor's name in the group.
        uncopied: Indices of the tensors on the packed request uncopied.
        outputs: Out of place, the uncopied tensors' results by index (flat).
        settle: Waits for a handle (driving the engine) at most the given seconds and
            swallows its error. All waits of one failed group share ``SETTLE_S``: a tensor
            sent alone, and a reported name, still end after the packed request failed,
            so their names are free again when the caller's call returns. (Not so for a
            name only some ranks have, when the groups differ in length: it ends at the
            collective timeout.)
    """

    def __init__(self, handle: Handle, arrays: Sequence[Any], members: list[int],
                 inplace: bool, report: Callable[[list[str], BaseException], list[Handle]],
                 names: list[str], settle: Callable[[Handle, float], None],
                 uncopied: Sequence[int] = (),
                 outputs: dict[int, np.ndarray] | None = None) -> None:
        self.handle = handle
        self._settle = settle
        self._settle_by: float | None = None
        self._arrays = arrays
        self._inplace = inplace
        self._report = report
        self._names = names
        self._members = [*members, *uncopied]  # every tensor the packed request carries
        self._outputs = outputs or {}
        self.slots = slots_of(arrays, members)
        self._reported = False

    def settle(self, handle: Handle) -> None:
        """Let ``handle`` end, within what is left of the group's ``SETTLE_S``."""
        if self._settle_by is None:
            self._settle_by = time.monotonic() + SETTLE_S
        self._settle(handle, max(0.0, self._settle_by - time.monotonic()))

    def failed(self) -> bool:
        """True once the packed request finished with an error."""
        return self.handle.done() and self.handle.error is not None

    def result(self, timeout: float, waited: float | None = None) -> np.ndarray:
        """The reduced packed array (raises the packed request's error, after failing the
        packed tensors' names on every rank once)."""
        try:
            return self.handle.wait(timeout, waited)
        except BaseException as exc:
            if self.failed() and not self._reported:
                self._reported = True
                # Sent all before waiting on any: other ranks' reports may wait on ours.
                for report in self._report([self._names[i] for i in self._members], exc):
                    self.settle(report)
            raise

    def part(self, index: int, timeout: float, waited: float | None = None) -> np.ndarray:
        """Tensor ``index``'s result: the caller's own array (in place: the packed
        request's finish wrote it back, see ``scatter``, or the backend reduced it there),
        its own output (uncopied, out of place), or a copy of its slice of the packed
        result shaped as the input (a view would keep the whole packed array alive as long
        as the caller keeps any one small result)."""
        packed = self.result(timeout, waited)
        target = self._arrays[index]
        if self._inplace:
            return target
        if index in self._outputs:
            return self._outputs[index].reshape(np.shape(target))
        offset, size = self.slots[index]
        return packed[offset : offset + size].reshape(np.shape(target)).copy()


class PartHandle(Handle):
    """A packed tensor's handle: done with the packed request, its result a part of it."""

    def __init__(self, name: str, pack: Pack, index: int) -> None:  # noqa: D107
        # No lock of its own: everything defers to the packed request's handle.
        self.name = name
        self._pack = pack
        self._index = index
        self._value: Any = None
        self._have = False

    def done(self) -> bool:  # noqa: D102
        return self._pack.handle.done()

    @property
    def error(self) -> BaseException | None:  # noqa: D102
        return self._pack.handle.error

    def wait_done(self, timeout: float) -> bool:  # noqa: D102
        return self._pack.handle.wait_done(timeout)

    def wait(self, timeout: float, waited: float | None = None) -> Any:  # noqa: D102
        if not self._have:
            self._value = self._pack.part(self._index, timeout, waited)
            self._have = True
        return self._value

    def set_result(self, result: Any) -> None:  # noqa: D102
        raise TypeError("a packed tensor's handle completes with its packed request")

    set_error = set_result


class GuardedHandle(Handle):
    """A tensor of a packed group sent on its own: its own handle, but the packed
    request's error comes first (when the groups differ between ranks, this tensor's
    partner may have been packed elsewhere and never come)."""

    def __init__(self, inner: Handle, pack: Pack) -> None:  # noqa: D107
        self.name = inner.name
        self._inner = inner
        self._pack = pack

    def done(self) -> bool:  # noqa: D102
        return self._inner.done() or self._pack.failed()

    @property
    def error(self) -> BaseException | None:  # noqa: D102
        return self._pack.handle.error if self._pack.failed() else self._inner.error

    def wait_done(self, timeout: float) -> bool:  # noqa: D102
        return self.done() or self._inner.wait_done(timeout)

    def wait(self, timeout: float, waited: float | None = None) -> Any:  # noqa: D102
        if self._pack.failed():
            try:
                self._pack.result(timeout)  # raises the packed request's error
            finally:
                # After the reports: a partner this tensor waits for may need them.
                self._pack.settle(self._inner)
        return self._inner.wait(timeout, waited)

    def set_result(self, result: Any) -> None:  # noqa: D102
        raise TypeError("a guarded handle completes with its own operation")

    set_error = set_result
