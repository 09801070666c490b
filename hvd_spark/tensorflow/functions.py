"""Objects, variables, process sets and runtime scalars for the TensorFlow binding.

``broadcast_object(_fn)``, ``allgather_object``, ``broadcast_variables``,
``broadcast_global_variables``, ``join``, the ``*_op`` scalars that Horovod evaluates
when the graph runs, and the process-set functions (which also remember sets by id, for
``size_op(process_set_id=...)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hvd_spark import collectives as C
from hvd_spark.collectives.process_sets import ProcessSet, global_process_set
from hvd_spark.errors import ConfigError
from hvd_spark.tensorflow import half_kernels, kernel
from hvd_spark.tensorflow.gather_ops import broadcast_

# Process sets seen by this binding, by id, for the *_op(process_set_id=...) functions.
_sets: dict[int, ProcessSet] = {}


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None) -> None:
    """Join the job (a one-rank job without a launcher); safe to call more than once.

    The first call also lends TensorFlow's float16 kernels to the collectives
    (``half_kernels.register_once``) unless another binding's are registered.
    """
    half_kernels.register_once()
    C.init(comm, process_sets=process_sets)
    for ps in process_sets or ():
        if ps.process_set_id is not None:
            _sets[ps.process_set_id] = ps


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set on every rank (a collective); returns it with its id."""
    ps = C.add_process_set(process_set)
    _sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (a collective); False if it was not added."""
    ps_id = process_set.process_set_id
    removed = C.remove_process_set(process_set)
    if removed and ps_id is not None:
        _sets.pop(ps_id, None)
    return removed


def _process_set(process_set_id: int) -> ProcessSet | None:
    return global_process_set if process_set_id == 0 else _sets.get(process_set_id)


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank as an int32 tensor, read when the op runs."""
    return kernel.scalar_op(C.rank, name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank on its host, as an int32 tensor read when the op runs."""
    return kernel.scalar_op(C.local_rank, name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of ranks on this host, as an int32 tensor read when the op runs."""
    return kernel.scalar_op(C.local_size, name)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks (of the process set), as an int32 tensor read when the op runs."""
    def value() -> int:
        ps = _process_set(process_set_id)
        if ps is None:
            raise ConfigError(f"size_op: no process set with id {process_set_id} was added")
        return kernel.members_size(ps)

    return kernel.scalar_op(value, name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this rank belongs to the process set, 0 if not, -1 if the set is unknown."""
    def value() -> int:
        ps = _process_set(process_set_id)
        if ps is None:
            return -1
        return 1 if ps is global_process_set or ps.included() else 0

    return kernel.scalar_op(value, name)


def join() -> tf.Tensor:
    """This rank has no more data: serve the others' allreduces with zeros until all join.

    Returns:
        The last rank to join, as an int32 tensor (evaluated when a graph runs it).
    """
    return kernel.run(lambda: [np.int32(C.join())], [], [tf.int32])[0]


def barrier(name: str | None = None, process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank (of ``process_set``) has called ``barrier``."""
    C.barrier(name, process_set=process_set)


def broadcast_object(obj: Any = None, root_rank: int = 0, session: Any = None,
                     name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return root's picklable ``obj`` on every rank (eager or not: no session needed)."""
    del session
    return C.broadcast_object(obj, root_rank, name, process_set=process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function ``obj -> root's obj`` (Horovod builds it for TF1 sessions; none needed)."""
    del session
    calls = iter(range(1 << 62))
    base = name or "broadcast_object_fn"

    def bcast(obj: Any) -> Any:
        return C.broadcast_object(obj, root_rank, f"{base}.{next(calls)}",
                                  process_set=process_set)

    return bcast


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order."""
    del session
    return C.allgather_object(obj, name, process_set=process_set)


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set, inplace: bool = False,
                        name: str | None = None) -> Any:
    """Overwrite every variable with root's value.

    Eagerly the assignment happens now (returns None), after the ranks checked that they
    hold the same shapes and dtypes, so a mismatch is an error on every rank rather than
    a wait. In a graph it returns the op that assigns.
    """
    del inplace
    variables = list(variables)
    if tf.executing_eagerly():
        signature = [(tuple(v.shape), tf.as_dtype(v.dtype).name) for v in variables]
        check_same_everywhere(signature, None, "broadcast_variables", process_set)
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    values = broadcast_(variables, root_rank, name, process_set)
    if tf.executing_eagerly():
        return None
    return tf.group(*values)


def broadcast_global_variables(root_rank: int) -> tf.Operation:
    """TF1 graphs: the op that broadcasts every global variable from ``root_rank``.

    Raises:
        RuntimeError: Called eagerly (there are no global variables): use
            ``broadcast_variables(model.variables, root_rank)``.
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables works in TF1 graphs only; eagerly, call "
            "hvd.broadcast_variables(model.variables, root_rank=0) (and the optimizer's "
            "variables) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def check_same_everywhere(value: Any, name: str | None, what: str,
                          process_set: ProcessSet = global_process_set) -> None:
    """Raise ConfigError on every rank unless ``value`` is equal on all ranks."""
    seen = C.allgather_object(value, name, process_set=process_set)
    bad = [r for r, v in enumerate(seen) if v != seen[0]]
    if bad:
        raise ConfigError(
            f"{what}: ranks {bad} disagree with rank 0 on the tensors involved "
            f"({_difference(seen[0], seen[bad[0]], bad[0])}); "
            "build the same model and optimizer on every rank")


def _difference(first: Any, other: Any, rank: int) -> str:
    if isinstance(first, list) and isinstance(other, list):
        if len(first) != len(other):
            return f"rank 0 has {len(first)} tensors, rank {rank} has {len(other)}"
        i = next(i for i, (a, b) in enumerate(zip(first, other)) if a != b)
        return f"tensor #{i}: rank 0 has {first[i]}, rank {rank} has {other[i]}"
    return f"rank 0: {first!r}, rank {rank}: {other!r}"
