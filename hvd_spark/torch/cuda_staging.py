"""CUDA gradients through pinned host buffers, without stalling backward().

The engine reduces on the CPU, so a CUDA gradient must visit host memory. A plain
``tensor.cpu()`` inside a gradient hook waits for the GPU to finish everything queued
so far, and while it waits the Python thread queues no more backward kernels: the
GPU idles. Here the device-to-host copy goes to a pinned buffer with
``non_blocking=True`` (queued on the gradient's stream; the hook returns at once), a
CUDA event marks its end, and a helper thread waits for that event before it submits
the allreduce. The result returns with another queued copy on the same stream, so
every later kernel that reads the gradient (the optimizer's step) runs after it.
Host buffers are kept per parameter and reused every step: the next step's copy into
a buffer is queued on the same stream after the copy out of it, so they never overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import torch

from hvd_spark import _env
from hvd_spark import collectives as C
from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.config import DEFAULT_TIMEOUT_S
from hvd_spark.errors import CollectiveTimeoutError
from hvd_spark.torch.tensor_ops import as_numpy


class StagedHandle:
    """One CUDA tensor's pending in-place allreduce; ``wait()`` returns the tensor."""

    def __init__(self, submitted: Future, index: int, tensor: torch.Tensor,
                 host: torch.Tensor, stream: Any, timeout_s: float) -> None:
        self._submitted = submitted
        self._index = index
        self._tensor = tensor
        self._host = host
        self._stream = stream
        self._timeout_s = timeout_s

    def done(self) -> bool:
        """True when the reduced values are in the host buffer."""
        return self._submitted.done() and self._submitted.result()[self._index].done()

    def wait(self) -> torch.Tensor:
        """Wait for the reduction, queue the copy back to the GPU, return the tensor."""
        try:
            handles = self._submitted.result(timeout=self._timeout_s)
        except FutureTimeoutError:
            raise CollectiveTimeoutError(
                f"a CUDA gradient's copy to the host did not finish within "
                f"{self._timeout_s:.0f} s; the GPU is stuck or far behind"
            ) from None
        C.synchronize(handles[self._index])
        with torch.cuda.stream(self._stream):
            self._tensor.copy_(self._host, non_blocking=True)
        return self._tensor


class CudaStager:
    """Starts in-place allreduces of CUDA tensors via pinned host buffers (see module doc)."""

    def __init__(self) -> None:
        self._hosts: dict[Any, torch.Tensor] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hvd_spark-cuda-stage")
        self._timeout_s = _env.get_float(_env.TIMEOUT, DEFAULT_TIMEOUT_S)

    def allreduce_async_(
        self, items: Sequence[tuple[Any, torch.Tensor, str]], op: ReduceOp,
        prescale_factor: float, postscale_factor: float,
        process_set: C.ProcessSet = C.global_process_set,
    ) -> list[StagedHandle]:
        """Start allreduces of ``(key, tensor, name)`` items, all on one CUDA device.

        ``key`` identifies the tensor's host buffer from step to step (the parameter).
        """
        device = items[0][1].device
        stream = torch.cuda.current_stream(device)
        hosts = []
        for key, tensor, _ in items:
            host = self._host_buffer(key, tensor)
            host.copy_(tensor, non_blocking=True)
            hosts.append(host)
        copied = torch.cuda.Event()
        copied.record(stream)
        arrays = [(as_numpy(host), name) for host, (_, _, name) in zip(hosts, items)]
        submitted = self._executor.submit(
            _submit_when_copied, copied, arrays, op, prescale_factor, postscale_factor,
            process_set)
        return [StagedHandle(submitted, i, tensor, host, stream, self._timeout_s)
                for i, (host, (_, tensor, _)) in enumerate(zip(hosts, items))]

    def _host_buffer(self, key: Any, tensor: torch.Tensor) -> torch.Tensor:
        host = self._hosts.get(key)
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._hosts[key] = host
        return host

    def close(self) -> None:
        """Stop the helper thread (pending submissions finish first)."""
        self._executor.shutdown(wait=True)


def _submit_when_copied(copied: Any, arrays: list, op: ReduceOp, prescale: float,
                        postscale: float, process_set: C.ProcessSet) -> list:
    copied.synchronize()  # blocks this helper thread only
    return C.allreduce_many_async_([a for a, _ in arrays], [n for _, n in arrays], op,
                                   prescale, postscale, process_set)
