"""CUDA tensors on the device path: NCCL / CUDA IPC, no host copy, no host sync.

When the job has a device path (cupy installed, ``HVD_SPARK_GPU_BACKEND`` not ``host``),
a contiguous CUDA tensor is handed to the collectives as a cupy view of its own memory
(DLPack: zero copy), ordered after torch's current stream by an event, and torch's
current stream is ordered after the collective by another event when the result is
taken. Otherwise (bfloat16, which cupy lacks; non-contiguous tensors; no device path)
callers keep the host path: pinned-buffer staging or a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hvd_spark import collectives as C
from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.torch.handles import TorchHandle

# cupy has no bfloat16; complex tensors are refused earlier.
_HOST_ONLY = (torch.bfloat16,)


def usable(tensors: Sequence[torch.Tensor], op: ReduceOp | None = None) -> bool:
    """True when these CUDA tensors can take the device path (for reduction ``op``)."""
    if op is not None and ReduceOp(op) == ReduceOp.Adasum:
        return False  # Adasum combines on the host
    if not tensors or not all(t.is_cuda for t in tensors):
        return False
    if any(t.dtype in _HOST_ONLY or not t.is_contiguous() for t in tensors):
        return False
    from hvd_spark.collectives import device_ops

    return device_ops.enabled()


def as_cupy(tensor: torch.Tensor) -> Any:
    """A cupy array sharing the tensor's device memory."""
    import cupy

    return cupy.from_dlpack(tensor.detach())


def _stream_ptr(tensor: torch.Tensor) -> int:
    return torch.cuda.current_stream(tensor.device).cuda_stream


def _handle(device_handle: Any, tensor: torch.Tensor, result) -> TorchHandle:
    """A TorchHandle whose wait orders torch's stream after the collective."""
    def finish(results: list) -> Any:
        event = device_handle.events.get("done")
        if event is not None:
            from hvd_spark.collectives.nccl import streams

            streams.consumer_waits(event, _stream_ptr(tensor))
        return result(results[0])

    return TorchHandle([device_handle.inner], finish)


def allreduce_many_async_(tensors: Sequence[torch.Tensor], names: Sequence[str], op: ReduceOp,
                          prescale_factor: float, postscale_factor: float,
                          process_set: C.ProcessSet = C.global_process_set) -> list[TorchHandle]:
    """In-place allreduces of CUDA tensors on the device (DistributedOptimizer's gradients)."""
    from hvd_spark.collectives import device_ops

    views = [as_cupy(t) for t in tensors]
    handles = device_ops.allreduce_many_async_(
        views, names, op, prescale_factor, postscale_factor, process_set,
        producer_stream=_stream_ptr(tensors[0]))
    return [_handle(h, t, lambda _, t=t: t) for h, t in zip(handles, tensors)]


def allreduce_async(tensor: torch.Tensor, name: str | None, op: ReduceOp,
                    prescale_factor: float, postscale_factor: float,
                    process_set: C.ProcessSet, in_place: bool) -> TorchHandle:
    """One allreduce on the device; out of place, the result is a new CUDA tensor."""
    from hvd_spark.collectives import device_ops

    target = tensor if in_place else tensor.clone()  # queued on torch's stream: ordered
    (handle,) = device_ops.allreduce_many_async_(
        [as_cupy(target)], [name], op, prescale_factor, postscale_factor, process_set,
        producer_stream=_stream_ptr(tensor))
    return _handle(handle, tensor, lambda _: target)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None,
                    process_set: C.ProcessSet, in_place: bool) -> TorchHandle:
    """Broadcast root's CUDA tensor on the device."""
    from hvd_spark.collectives import device_ops

    target = tensor if in_place else tensor.clone()
    handle = device_ops.broadcast_async_(as_cupy(target), root_rank, name, process_set,
                                         producer_stream=_stream_ptr(tensor))
    return _handle(handle, tensor, lambda _: target)


def allgather_async(tensor: torch.Tensor, name: str | None,
                    process_set: C.ProcessSet) -> TorchHandle:
    """Allgather CUDA tensors on the device; the result is a new CUDA tensor."""
    from hvd_spark.collectives import device_ops

    handle = device_ops.allgather_async(as_cupy(tensor), name, process_set,
                                        producer_stream=_stream_ptr(tensor))
    return _handle(handle, tensor, lambda out: torch.from_dlpack(out))
