"""The reducing collectives on numpy arrays: allreduce (plain, in place, batched,
grouped and packed) and reducescatter.

Each op checks its arguments in a ``build`` function that ``submit`` runs under the
operation's name, so a refused tensor fails on every rank with this rank's reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from hvd_spark.collectives import messages as m
from hvd_spark.collectives import packing
from hvd_spark.collectives.buffers import OUTPUTS
from hvd_spark.collectives.operations import Entry, Handle
from hvd_spark.collectives.ops import ReduceOp, check_reduction, scale_in_place
from hvd_spark.collectives.process_sets import ProcessSet, global_process_set
from hvd_spark.collectives.session import STATE, require
from hvd_spark.collectives.submit import (
    Build,
    Members,
    as_array,
    auto_name,
    check_list,
    group_names,
    grouped,
    in_place_finish,
    members_of,
    report_failure,
    start,
    submit_many,
    synchronize,
    wait_all,
)
from hvd_spark.errors import CollectiveArgumentError, ConfigError, HvdSparkError


def _eager_bytes(lone: bool) -> int:
    """Largest allreduce that travels with its negotiation (the engine's setting): larger
    for a ``lone`` one, whose caller waits for it at once (see ``EngineConfig``)."""
    engine = STATE.engine
    if engine is None:
        return 0
    return engine.lone_eager_bytes if lone else engine.eager_bytes


def _allreduce_build(array: np.ndarray, op: ReduceOp, prescale: float, postscale: float,
                     inplace: bool, lone: bool = False) -> Build:
    def build(key: str, members: Members) -> tuple:
        arr = as_array(array, f"allreduce {key!r}")
        reduce_op = ReduceOp(op)
        source = None
        if inplace:
            if not arr.flags.writeable:
                raise CollectiveArgumentError(f"allreduce_ {key!r}: the array is read-only")
            work = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
        elif prescale != 1.0:
            work = OUTPUTS.empty(arr.shape, arr.dtype)
            np.copyto(work, arr)
        else:
            # Out of place: the backend reads the caller's input where it can and writes
            # a fresh array, instead of copying the input first (see Entry.source). Its
            # memory comes from the output pool, so a repeated allreduce pays no page
            # faults, and it is aligned, so frameworks adopt it uncopied.
            source = np.asarray(arr, order="C")  # (ascontiguousarray would make 0-d 1-d)
            work = OUTPUTS.empty(source.shape, source.dtype)
        check_reduction(work.dtype, reduce_op, prescale, postscale, key)
        if prescale != 1.0:
            if work is arr:
                work = np.array(work, copy=True)  # never scale the caller's data before sending
            scale_in_place(work, prescale)
        payload = None
        if work.nbytes <= _eager_bytes(lone) and reduce_op != ReduceOp.Adasum:
            # Small: the tensor rides on the request and rank 0 reduces it (no ring).
            payload = (work if source is None else source).reshape(-1)
        request = m.Request(key, m.ALLREDUCE, m.dtype_name(work.dtype), work.shape, int(reduce_op),
                            float(prescale), float(postscale), members=members,
                            payload=payload)
        if source is not None:
            return request, work, None, source
        return request, work, (in_place_finish(arr) if inplace else None)

    return build


def _allreduce_start(array: np.ndarray, name: str | None, op: ReduceOp, prescale: float,
                     postscale: float,
                     process_set: ProcessSet, inplace: bool, lone: bool = False) -> Handle:
    """Start an allreduce (``lone``: the caller waits for it at once, see ``_eager_bytes``)."""
    build = _allreduce_build(array, op, prescale, postscale, inplace, lone)
    return start(m.ALLREDUCE, name, process_set, build)


def allreduce_async(array: np.ndarray, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allreduce of ``array``; the handle's result is a new array."""
    return _allreduce_start(array, name, op, prescale_factor, postscale_factor, process_set,
                            inplace=False)


def allreduce_async_(array: np.ndarray, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place allreduce: ``array`` itself receives the result."""
    return _allreduce_start(array, name, op, prescale_factor, postscale_factor, process_set,
                            inplace=True)


def _express(array: np.ndarray, name: str | None, op: ReduceOp, prescale: float,
             postscale: float, process_set: ProcessSet,
             inplace: bool) -> tuple[Any, str | None]:
    """Try the engine's express path for a synchronous allreduce (see
    ``EngineCore.express_allreduce``).

    Returns:
        ``(result, name)``: the result, or None with the name to submit it under (an
        automatic name is taken here, once).
    """
    engine = STATE.engine
    if (engine is None or process_set is not global_process_set or prescale != 1.0
            or type(array) is not np.ndarray):
        return None, name
    if name is None:
        name = auto_name(m.ALLREDUCE, name)
    return engine.express_allreduce(name, array, op, postscale, inplace), name


def allreduce(array: np.ndarray, name: str | None = None, op: ReduceOp = ReduceOp.Average,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce ``array`` across ranks (Average by default) and return a new array."""
    result, name = _express(array, name, op, prescale_factor, postscale_factor, process_set,
                            inplace=False)
    if result is not None:
        return result
    return synchronize(_allreduce_start(array, name, op, prescale_factor, postscale_factor,
                                        process_set, inplace=False, lone=True))


def allreduce_(array: np.ndarray, name: str | None = None, op: ReduceOp = ReduceOp.Average,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce ``array`` across ranks in place; returns ``array``."""
    result, name = _express(array, name, op, prescale_factor, postscale_factor, process_set,
                            inplace=True)
    if result is not None:
        return result
    return synchronize(_allreduce_start(array, name, op, prescale_factor, postscale_factor,
                                        process_set, inplace=True, lone=True))


def allreduce_many_async_(
    arrays: Sequence[np.ndarray], names: Sequence[str], op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[Handle]:
    """Start in-place allreduces of ``arrays`` named ``names``, submitted in one batch.

    Unlike ``grouped_allreduce``, each array keeps its own name and is matched across
    ranks on its own, so ranks may batch different sets of arrays (a DistributedOptimizer's
    buckets can differ between ranks); one request message carries the whole batch.
    """
    if len(arrays) != len(names):
        raise ConfigError(f"allreduce_many_async_ got {len(arrays)} arrays but {len(names)} names")
    members = members_of(process_set, "allreduce")
    keys = [auto_name(m.ALLREDUCE, n, process_set) for n in names]
    builds = [_allreduce_build(a, op, prescale_factor, postscale_factor, inplace=True)
              for a in arrays]
    return submit_many(m.ALLREDUCE, keys, builds, members)


def _grouped_allreduce(arrays: Sequence[np.ndarray], name: str | None, op: ReduceOp,
                       prescale: float, postscale: float,
                       process_set: ProcessSet, inplace: bool) -> list[Handle]:
    """A grouped allreduce: its small tensors packed into one request, its large ones of
    the same dtype riding on that request uncopied, the others one by one, all in one
    batch (see ``packing``)."""
    check_list(m.ALLREDUCE, arrays)
    members, base, keys = group_names(m.ALLREDUCE, len(arrays), name, process_set)
    if not keys:
        return []  # nothing to send (the automatic name is used up on every rank alike)

    def build(a: np.ndarray) -> Build:
        return _allreduce_build(a, op, prescale, postscale, inplace)

    packed = packing.plan(arrays, op, inplace)
    if packed is None:
        return submit_many(m.ALLREDUCE, keys, [build(a) for a in arrays], members)
    uncopied = packing.uncopied(arrays, packed, prescale)
    on_pack = {*packed, *uncopied}
    alone = [i for i in range(len(arrays)) if i not in on_pack]
    layout = packing.layout_of(arrays, [*packed, *uncopied])
    gathered = packing.gather(arrays, packed,
                              arrays[uncopied[0]].dtype if uncopied else np.float32)
    pack_build = _allreduce_build(gathered, op, prescale, postscale, inplace=True)
    outputs: dict[int, np.ndarray] = {}

    def build_pack(key: str, members: Members) -> tuple | Entry:
        if packed or uncopied:  # a refused reduction names a tensor, not the internal key
            check_reduction(gathered.dtype, ReduceOp(op), prescale, postscale,
                            keys[(packed or uncopied)[0]])
        request, work, _ = pack_build(key, members)

        # The large tensors ride behind the packed array, where they lie (in place) or
        # into fresh outputs; a non-contiguous one in a contiguous copy.
        inputs = [_uncopied_input(arrays[i], keys[i], inplace) for i in uncopied]
        copied = [(arrays[i], flat) for i, flat in zip(uncopied, inputs)
                  if inplace and not arrays[i].flags.c_contiguous]

        def finish(result: np.ndarray) -> np.ndarray:
            if inplace:  # when the request completes, as any in-place allreduce
                packing.scatter(result, arrays, packed)
                for target, flat in copied:
                    target[...] = flat.reshape(target.shape)
            return result

        if not uncopied:
            return dataclasses.replace(request, layout=layout), work, finish
        parts, sources = inputs, None
        if not inplace:
            sources, parts = inputs, [OUTPUTS.empty((p.size,), p.dtype) for p in inputs]
            outputs.clear()
            outputs.update(zip(uncopied, parts))
        # The request's shape is the whole; it is never eager.
        total = work.size + sum(p.size for p in parts)
        request = dataclasses.replace(request, layout=layout, shape=(total,), payload=None)
        return Entry(request, Handle(key), work, finish, parts=parts, part_sources=sources)

    pack_key = _pack_key(base)
    handles = submit_many(m.ALLREDUCE, [pack_key, *(keys[i] for i in alone)],
                          [build_pack, *(build(arrays[i]) for i in alone)], members,
                          fail_keys=[pack_key, *keys])

    def settle(handle: Handle, seconds: float) -> None:
        try:
            require()[1].wait(handle, seconds)
        except HvdSparkError:
            pass  # the caller gets the packed request's error (or the name stays busy)

    def report(names: list[str], exc: BaseException) -> list[Handle]:
        handles = [report_failure(m.ALLREDUCE, key, exc, members) for key in names]
        return [h for h in handles if h is not None]

    pack = packing.Pack(handles[0], arrays, packed, inplace, report, keys, settle, uncopied,
                        outputs)
    own = dict(zip(alone, handles[1:]))
    return [packing.GuardedHandle(own[i], pack) if i in own else
            packing.PartHandle(keys[i], pack, i) for i in range(len(arrays))]


def _pack_key(base: str) -> str:
    """The name of a grouped allreduce's packed request."""
    return f"{base}.packed"


def report_grouped_failure(kind: str, count: int, name: str | None, exc: BaseException,
                           process_set: ProcessSet = global_process_set) -> None:
    """Tell the other ranks that this rank refused a grouped call of ``count`` tensors.

    For a framework that checks its tensors before handing them to the grouped call:
    the other ranks' copy fails with this rank's reason (whichever of its requests they
    sent: the packed one or a tensor's own) instead of waiting, and the automatic name is
    used up here as there.
    """
    members, base, keys = group_names(kind, count, name, process_set)
    if kind == m.ALLREDUCE:
        keys = [_pack_key(base), *keys]
    for key in keys:
        report_failure(kind, key, exc, members)


def _uncopied_input(array: np.ndarray, key: str, inplace: bool) -> np.ndarray:
    """A large tensor of a grouped allreduce as its packed request reads it: flat, the
    caller's memory when contiguous (in place the backend writes there too)."""
    if inplace and not array.flags.writeable:
        raise CollectiveArgumentError(f"allreduce_ {key!r}: the array is read-only")
    return np.ascontiguousarray(array).reshape(-1)


def grouped_allreduce_async(
    arrays: Sequence[np.ndarray], name: str | None = None, op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[Handle]:
    """Start allreduces of several arrays as one fused batch; results are new arrays."""
    return _grouped_allreduce(arrays, name, op, prescale_factor, postscale_factor,
                              process_set, inplace=False)


def grouped_allreduce_async_(
    arrays: Sequence[np.ndarray], name: str | None = None, op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[Handle]:
    """Start in-place allreduces of several arrays as one fused batch."""
    return _grouped_allreduce(arrays, name, op, prescale_factor, postscale_factor,
                              process_set, inplace=True)


def grouped_allreduce(arrays: Sequence[np.ndarray], name: str | None = None,
                      op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Allreduce several arrays as one fused operation; returns new arrays."""
    return wait_all(grouped_allreduce_async(arrays, name, op, prescale_factor,
                                            postscale_factor, process_set))


def grouped_allreduce_(arrays: Sequence[np.ndarray], name: str | None = None,
                       op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Allreduce several arrays in place as one fused operation."""
    return wait_all(grouped_allreduce_async_(arrays, name, op, prescale_factor,
                                             postscale_factor, process_set))


def _reducescatter_build(array: np.ndarray, op: ReduceOp, prescale: float,
                         postscale: float) -> Build:
    def build(key: str, members: Members) -> tuple:
        arr = as_array(array, f"reducescatter {key!r}")
        if arr.ndim == 0:
            raise CollectiveArgumentError(
                f"reducescatter {key!r} needs a tensor of rank >= 1 (it splits dim 0), got a "
                "scalar")
        work = np.array(arr, order="C", copy=True)
        reduce_op = ReduceOp(op)
        if reduce_op == ReduceOp.Adasum:
            raise CollectiveArgumentError(
                f"reducescatter {key!r}: Adasum is only supported by allreduce")
        check_reduction(work.dtype, reduce_op, prescale, postscale, key)
        scale_in_place(work, prescale)
        request = m.Request(key, m.REDUCESCATTER, m.dtype_name(work.dtype), work.shape,
                            int(reduce_op), float(prescale), float(postscale), members=members)
        return request, work, None

    return build


def reducescatter_async(
    array: np.ndarray, name: str | None = None, op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Handle:
    """Start a reduce-scatter: reduce across ranks, each keeps its block of dim-0 rows."""
    build = _reducescatter_build(array, op, prescale_factor, postscale_factor)
    return start(m.REDUCESCATTER, name, process_set, build)


def reducescatter(array: np.ndarray, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce across ranks; return this rank's block of rows (first ranks get extra rows)."""
    return synchronize(reducescatter_async(array, name, op, prescale_factor, postscale_factor,
                                           process_set))


def grouped_reducescatter_async(
    arrays: Sequence[np.ndarray], name: str | None = None, op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[Handle]:
    """Start reduce-scatters of several arrays, submitted together."""
    return grouped(m.REDUCESCATTER, arrays, name, process_set, lambda a: _reducescatter_build(
        a, op, prescale_factor, postscale_factor))


def grouped_reducescatter(arrays: Sequence[np.ndarray], name: str | None = None,
                          op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0,
                          process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    """Reduce-scatter several arrays; returns this rank's block of each."""
    handles = grouped_reducescatter_async(arrays, name, op, prescale_factor, postscale_factor,
                                          process_set)
    return [synchronize(h) for h in handles]
