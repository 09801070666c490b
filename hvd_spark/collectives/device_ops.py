"""Collectives on CUDA device arrays (cupy, or any ``__cuda_array_interface__`` via DLPack).

The same engine negotiates them (names, fusion, agreement that they are on the GPU);
their bytes take the job's device path: NCCL, CUDA IPC between ranks sharing a GPU,
or host staging. Nothing here waits for the GPU: the collective stream waits for the
producer's stream (an event), and ``DeviceHandle.wait`` makes the consumer's stream
wait for the collective (another event). Frameworks pass their streams' raw handles.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from hvd_spark.collectives import messages as m
from hvd_spark.collectives import session, submit
from hvd_spark.collectives.nccl import arrays, library, selection, streams
from hvd_spark.collectives.nccl.device import DeviceAwareCommunicator
from hvd_spark.collectives.operations import Handle
from hvd_spark.collectives.ops import ReduceOp, check_reduction
from hvd_spark.collectives.process_sets import ProcessSet, global_process_set
from hvd_spark.errors import CollectiveArgumentError


def enabled() -> bool:
    """True when this job's collectives accept device arrays (a device path is set up and
    cupy loads).

    Asked for CUDA tensors: a False for want of cupy (not installed, or failing to load)
    sends them through host memory, said once in a warning on rank 0 naming the package;
    ``HVD_SPARK_GPU_BACKEND=host`` asks for that and stays quiet.
    """
    engine = session.current_engine()
    if engine is None:
        return False
    if selection.gpu_backend_setting() == selection.HOST:
        return False
    problem = library.cupy_problem()
    if problem is None and not isinstance(engine.comm, DeviceAwareCommunicator):
        problem = "no device path was set up when the engine started"
    if problem is None:
        return True
    if engine.comm.rank == 0:
        library.warn_host_staging(problem)
    return False


class DeviceHandle:
    """A pending device collective; ``wait`` orders the consumer after it (no host sync)."""

    def __init__(self, inner: Handle, events: dict[str, Any]) -> None:
        self.inner = inner
        self.events = events  # the collective's CUDA events by role ("done")

    def done(self) -> bool:
        """True once the collective is queued on the GPU (or failed)."""
        return self.inner.done()

    def wait(self, consumer_stream: int | None = None) -> Any:
        """The result, with ``consumer_stream`` (raw handle; None: cupy's current) ordered
        after the collective's kernels."""
        result = submit.synchronize(self.inner)
        event = self.events.get("done")
        if event is not None:
            streams.consumer_waits(event, consumer_stream)
        return result


@contextlib.contextmanager
def _on(device_id: int) -> Iterator[None]:
    """The caller's cupy work on the tensors' device and the collective stream (ordered
    after the producer's event already waited for)."""
    with library.cupy().cuda.Device(device_id), streams.collective_stream(device_id):
        yield


def _device_id(array: Any) -> int:
    return int(array.device.id)


def _check(array: Any, what: str) -> Any:
    if not arrays.is_device(array):
        raise CollectiveArgumentError(f"{what} expects a CUDA device array, got "
                                      f"{type(array).__name__}")
    if not array.flags.c_contiguous:
        raise CollectiveArgumentError(f"{what}: the device array must be C-contiguous")
    return array


def _finishing(device_id: int, then=None):
    """A finish step recording the done event (engine thread, after the kernels)."""
    events: dict[str, Any] = {}

    def finish(result: Any) -> Any:
        out = then(result) if then is not None else result
        events["done"] = streams.done_event(device_id)
        return out

    return events, finish


def _request(key: str, kind: str, work: Any, members, **fields) -> m.Request:
    return m.Request(key, kind, work.dtype.name, tuple(work.shape), members=members,
                     device=arrays.CUDA, **fields)


def allreduce_many_async_(
    device_arrays: Sequence[Any], names: Sequence[str | None],
    op: ReduceOp = ReduceOp.Average,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set, producer_stream: int | None = None,
) -> list[DeviceHandle]:
    """In-place allreduces of device arrays, each matched by its own name, one batch.

    Args:
        names: One per array; None takes the next automatic name, as on the host path.
        producer_stream: Raw handle of the stream that wrote the arrays (torch's current
            stream); None for cupy's current stream.
    """
    if len(device_arrays) != len(names):
        raise CollectiveArgumentError(
            f"allreduce_many_async_ got {len(device_arrays)} arrays but {len(names)} names")
    members = submit.members_of(process_set, "allreduce")
    keys = [submit.auto_name(m.ALLREDUCE, n, process_set) for n in names]
    if device_arrays:
        streams.order_after(_device_id(device_arrays[0]), producer_stream)
    event_sets, builds = [], []
    for array in device_arrays:
        events, build = _allreduce_build(array, op, prescale_factor, postscale_factor)
        event_sets.append(events)
        builds.append(build)
    handles = submit.submit_many(m.ALLREDUCE, keys, builds, members)
    return [DeviceHandle(h, e) for h, e in zip(handles, event_sets)]


def _allreduce_build(array: Any, op: ReduceOp, prescale: float, postscale: float):
    target = array
    device_id = _device_id(array)

    def copy_back(result: Any) -> Any:
        if result is not target:
            target[...] = result.reshape(target.shape)
        return target

    events, finish = _finishing(device_id, copy_back)

    def build(key: str, members):
        work = _check(target, f"allreduce {key!r}")
        reduce_op = ReduceOp(op)
        if reduce_op == ReduceOp.Adasum:
            raise CollectiveArgumentError(f"allreduce {key!r}: Adasum runs on host arrays only")
        check_reduction(work.dtype, reduce_op, prescale, postscale, key)
        if prescale != 1.0:
            with _on(device_id):
                work = work * prescale  # a copy: the caller's tensor is not scaled early
        request = _request(key, m.ALLREDUCE, work, members, op=int(reduce_op),
                           prescale=float(prescale), postscale=float(postscale))
        return request, work, finish

    return events, build


def broadcast_async_(array: Any, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set,
                     producer_stream: int | None = None) -> DeviceHandle:
    """In-place broadcast of root's device array (``root_rank`` is a global rank)."""
    device_id = _device_id(_check(array, "broadcast"))
    streams.order_after(device_id, producer_stream)
    events, finish = _finishing(device_id)

    def build(key: str, members):
        root = submit.index_in_set(process_set, root_rank, f"broadcast {key!r}")
        return _request(key, m.BROADCAST, array, members, root=root), array, finish

    return DeviceHandle(submit.start(m.BROADCAST, name, process_set, build), events)


def allgather_async(array: Any, name: str | None = None,
                    process_set: ProcessSet = global_process_set,
                    producer_stream: int | None = None) -> DeviceHandle:
    """Concatenate every rank's device array along dim 0; the result is a new device array."""
    device_id = _device_id(_check(array, "allgather"))
    streams.order_after(device_id, producer_stream)
    events, finish = _finishing(device_id)
    work = array.reshape(1) if array.ndim == 0 else array

    def build(key: str, members):
        return _request(key, m.ALLGATHER, work, members), work, finish

    return DeviceHandle(submit.start(m.ALLGATHER, name, process_set, build), events)


def reducescatter_async(array: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                        process_set: ProcessSet = global_process_set,
                        producer_stream: int | None = None) -> DeviceHandle:
    """Reduce device arrays across ranks; each keeps its block of dim-0 rows (new array)."""
    device_id = _device_id(_check(array, "reducescatter"))
    if array.ndim == 0:
        raise CollectiveArgumentError("reducescatter needs a tensor of rank >= 1")
    streams.order_after(device_id, producer_stream)
    events, finish = _finishing(device_id)

    def build(key: str, members):
        reduce_op = ReduceOp(op)
        if reduce_op == ReduceOp.Adasum:
            raise CollectiveArgumentError(f"reducescatter {key!r}: Adasum is only for allreduce")
        check_reduction(array.dtype, reduce_op, 1.0, 1.0, key)
        with _on(device_id):
            work = array.copy()  # reduced in place: the caller keeps its input
        return _request(key, m.REDUCESCATTER, work, members, op=int(reduce_op)), work, finish

    return DeviceHandle(submit.start(m.REDUCESCATTER, name, process_set, build), events)


def alltoall_async(array: Any, splits: Sequence[int] | None = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set,
                   producer_stream: int | None = None) -> DeviceHandle:
    """Send rows ``splits[j]`` to rank j; the result is ``(received device array, splits)``."""
    device_id = _device_id(_check(array, "alltoall"))
    if array.ndim == 0:
        raise CollectiveArgumentError("alltoall needs a tensor of rank >= 1")
    streams.order_after(device_id, producer_stream)
    events, finish = _finishing(device_id)
    split_t = None if splits is None else tuple(int(s) for s in splits)

    def build(key: str, members):
        return _request(key, m.ALLTOALL, array, members, splits=split_t), array, finish

    return DeviceHandle(submit.start(m.ALLTOALL, name, process_set, build), events)
