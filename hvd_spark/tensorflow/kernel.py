"""How a numpy collective becomes a TensorFlow operation, eagerly and inside graphs.

Eagerly, the collective runs at once on numpy views of the tensors.

A graph collective is one node whose kernel blocks until every rank has submitted the same
name. TensorFlow runs ready nodes on a small inter-op thread pool (one thread per core),
shared by every graph and function the process runs. When several collectives can wait at
once in another order on each rank, plain ``numpy_function`` kernels deadlock: rank 0
blocks every pool thread in collectives A and B while rank 1 blocks its threads in C and
D, and nobody ever submits what the others wait for. Horovod avoids this with an
asynchronous C++ kernel. A pure-Python package cannot write one, but tf.data has one:
``DatasetToSingleElement`` runs its dataset on a background thread of its own and frees the
pool thread at once. So such a collective is a one-element dataset whose map function (run
inline on that background thread, ``use_inter_op_parallelism=False``) calls the numpy
collective: any number of them can wait at the same time, in any order per rank, and the
engine matches them by name, whatever the pool size.

That node costs about 0.4-1 ms more per call than a ``numpy_function``, which is kept where
collectives cannot wait at once:
- TF1-style graphs (``tf.compat.v1.Session``) give independent nodes no order: datasets.
- A ``tf.function`` chains its stateful ops in program order, so its own collectives run
  one at a time, the same on every rank. Two functions run at once only when called from
  two threads. Functions traced on the main thread (a training loop, Keras ``fit``) get
  ``numpy_function`` nodes; functions traced on another thread, which other threads may
  call at the same time, get datasets. (A function traced on the main thread and then
  called from several threads at once in different orders per rank can still deadlock,
  until the collective timeout fails it.)

Names are fixed when the node is built (see ``graph_name``), so every execution asks for
the same names on every rank.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hvd_spark import collectives as C
from hvd_spark.collectives import _plumbing
from hvd_spark.collectives.buffers import ALIGN_BYTES, aligned_empty
from hvd_spark.errors import CollectiveArgumentError, ConfigError

try:  # the one private TensorFlow name used: a map that runs inline (no inter-op pool)
    from tensorflow.python.data.ops.map_op import _MapDataset
except ImportError:  # pragma: no cover - other TensorFlow versions
    _MapDataset = None

try:  # private too: whether any GradientTape is recording now
    from tensorflow.python.eager.record import could_possibly_record as _tape_may_record
except ImportError:  # pragma: no cover - other TensorFlow versions
    def _tape_may_record() -> bool:
        return True

_DATA_OPTIONS = tf.data.Options()
_DATA_OPTIONS.experimental_optimization.apply_default_optimizations = False
_DATA_OPTIONS.autotune.enabled = False


def to_tensor(array: np.ndarray, dtype: tf.DType) -> tf.Tensor:
    """An eager tensor of a collective's fresh result, adopted through DLPack.

    ``tf.convert_to_tensor`` costs about 40 us per call, more than a small collective;
    DLPack about 1 us. TensorFlow requires 64-byte aligned data (it aborts the process
    otherwise), so an unaligned result is first copied into an aligned buffer. Types
    DLPack does not carry (bool, bfloat16) are converted as usual.
    """
    array = np.asarray(array)
    if array.size and array.dtype.kind in "fiu" and array.dtype == dtype.as_numpy_dtype:
        # Read-only arrays (views of input tensors) cannot be exported: copy those too.
        if not (array.flags.c_contiguous and array.flags.writeable
                and array.ctypes.data % ALIGN_BYTES == 0):
            aligned = aligned_empty(array.shape, array.dtype)
            np.copyto(aligned, array)
            array = aligned
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array, dtype=dtype)


def needs_gradient() -> bool:
    """Whether a collective must carry its gradient function: always in graphs, and
    eagerly only while a GradientTape records (``tf.custom_gradient`` costs over 100 us per
    eager call, more than a small collective itself; an optimizer's gradient allreduce runs
    after the tape)."""
    return not tf.executing_eagerly() or _tape_may_record()


def graph_name(kind: str, name: str | None) -> str | None:
    """The engine name of one op: the user's, a graph-unique one fixed now, or None (eager).

    Inside a graph the name is taken when the node is built, in program order, so the
    ranks agree on it however the runtime orders the nodes later.
    """
    if name is not None:
        return name
    if tf.executing_eagerly():
        return None  # the collectives number unnamed eager calls in program order
    return tf.compat.v1.get_default_graph().unique_name(f"hvd_{kind}", mark_as_used=True)


@functools.cache
def _tf_error_class(base: type) -> type:
    """``base`` that is also a ``tf.errors.FailedPreconditionError``, as Horovod raises."""

    def init(self, message: str) -> None:
        base.__init__(self, message)
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)

    def text(self) -> str:
        return self.message

    return type(base.__name__, (base, tf.errors.FailedPreconditionError),
                {"__init__": init, "__str__": text, "__module__": base.__module__})


def as_tf_error(exc: CollectiveArgumentError) -> Exception:
    """Ranks disagreeing on a collective's arguments: Horovod's ``FailedPreconditionError``.

    The error keeps its hvd_spark class too, so ``except CollectiveError`` still works.
    """
    return _tf_error_class(type(exc))(str(exc))


@tf.autograph.experimental.do_not_convert  # plain Python; the kernel runs as written
def run(fn: Callable[..., Sequence[np.ndarray]], inputs: Sequence[Any],
        touts: Sequence[tf.DType]) -> list[tf.Tensor]:
    """Run the numpy collective ``fn`` on ``inputs``: now if eager, as a graph node otherwise.

    Args:
        fn: Takes one numpy array per input, returns one array per ``touts`` entry.
        inputs: Tensors (or anything ``tf.convert_to_tensor`` takes).
        touts: The dtypes of the outputs.

    Returns:
        One tensor per output (shapes unknown in graphs: callers set them).
    """
    if tf.executing_eagerly():
        arrays = [np.asarray(t) for t in inputs]
        try:
            outs = fn(*arrays)
        except CollectiveArgumentError as exc:
            raise as_tf_error(exc) from exc
        return [to_tensor(o, d) for o, d in zip(outs, touts)]
    inputs = [tf.convert_to_tensor(t) for t in inputs]
    touts = list(touts)

    def kernel(*arrays: np.ndarray) -> list[np.ndarray]:
        outs = fn(*arrays)
        return [np.asarray(o, dtype=d.as_numpy_dtype) for o, d in zip(outs, touts)]

    def body(*ts: tf.Tensor):
        return tuple(tf.numpy_function(kernel, list(ts), touts, stateful=True))

    if _MapDataset is None or (tf.inside_function()
                               and threading.current_thread() is threading.main_thread()):
        # A tf.function traced on the main thread runs its collectives one after another:
        # a plain numpy_function cannot deadlock there (see the module docstring).
        return list(tf.numpy_function(kernel, inputs, touts, stateful=True))
    source = tf.data.Dataset.from_tensors(tuple(inputs))
    dataset = _MapDataset(source, body, use_inter_op_parallelism=False)
    outs = dataset.with_options(_DATA_OPTIONS).get_single_element()
    return list(outs) if isinstance(outs, (tuple, list)) else [outs]


def check_process_set(process_set: C.ProcessSet, what: str) -> None:
    """Horovod's checks when an op is built: an unknown set is a ValueError (ConfigError).

    Eagerly, a rank outside the set gets ``InvalidArgumentError`` at once, as in Horovod
    (in a graph the op raises it when it runs).
    """
    if process_set is C.global_process_set:
        return
    if not isinstance(process_set, C.ProcessSet):
        raise ConfigError(f"{what}: process_set must be a ProcessSet, got {process_set!r}")
    included = process_set.included()
    if included is None:
        raise ConfigError(f"{what}: {process_set} was not added on this rank (or was "
                          "removed); call add_process_set first")
    if not included and tf.executing_eagerly():
        raise tf.errors.InvalidArgumentError(
            None, None, f"{what}: rank {C.rank()} is not a member of {process_set}; only its "
            f"ranks {process_set.ranks} may call collectives on it")


def eager_name(kind: str, name: str | None, process_set: C.ProcessSet) -> str | None:
    """Eagerly, the call's automatic name, drawn *before* any check that may fail locally.

    A call that fails its checks on one rank only must still use up its number on that
    rank (and tell the others, see ``fail_locally``), or every later unnamed call would
    pair with the wrong partner. Graph names are fixed at build time instead.
    """
    if name is None and tf.executing_eagerly() and C.is_initialized():
        return _plumbing.auto_name(kind, None, process_set)
    return name


def fail_locally(kind: str, names: Sequence[str | None], process_set: C.ProcessSet,
                 exc: BaseException) -> BaseException:
    """Eagerly, report this rank's local failure of ``names`` to the other ranks.

    They then fail the same call with this rank's reason instead of waiting for a
    partner that never comes. Returns ``exc`` for the caller to raise.
    """
    if tf.executing_eagerly() and C.is_initialized():
        for name in names:
            if name is not None:
                key = _plumbing.auto_name(kind, name, process_set)  # the key the engine would use
                _plumbing.report_failure(kind, key, exc, process_set.members())
    return exc


def executing_eagerly() -> bool:
    """True outside graphs (Horovod's ``_executing_eagerly``)."""
    return tf.executing_eagerly()


def scalar_op(value: Callable[[], int], name: str | None) -> tf.Tensor:
    """An int32 tensor holding ``value()``, evaluated when the op runs (graphs) or now."""
    if tf.executing_eagerly():
        return tf.constant(value(), tf.int32, name=name)
    out = tf.numpy_function(lambda: np.int32(value()), [], tf.int32, stateful=True, name=name)
    out.set_shape([])
    return out


def size_tensor(process_set: C.ProcessSet) -> int | tf.Tensor:
    """The size of ``process_set``: an int eagerly, in a graph a tensor read when it runs.

    An elastic ring changes size between two runs of one traced function, so a divisor
    traced as a constant would go stale.
    """
    if tf.executing_eagerly():
        return members_size(process_set)
    return scalar_op(lambda: members_size(process_set), None)


def members_size(process_set: C.ProcessSet) -> int:
    """The number of ranks in ``process_set`` (the job's size for the global set)."""
    if process_set is C.global_process_set:
        return C.size()
    n = process_set.size()
    if n is None:
        raise CollectiveArgumentError(
            f"{process_set} was not added on this rank; call add_process_set first")
    return n
