"""torch.Tensor <-> numpy without copies, and the asynchronous tensor collectives.

Contiguous CPU tensors share their memory with the numpy arrays the collectives
engine works on, so in-place operations (``allreduce_``) move no extra bytes.
bfloat16 has no torch->numpy conversion: its bits are viewed as int16 and
reinterpreted as ``ml_dtypes.bfloat16``.

CUDA tensors are staged through a CPU copy and copied back on completion: this
pure-Python engine reduces on the CPU (an NCCL backend would avoid the copies).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hvd_spark import collectives as C
from hvd_spark.collectives import _plumbing
from hvd_spark.collectives.ops import BFLOAT16, ReduceOp
from hvd_spark.errors import ConfigError
from hvd_spark.torch.handles import TorchHandle

_COMPLEX = (torch.complex32, torch.complex64, torch.complex128)
# What travels: the dtypes with a numpy counterpart (bfloat16 through ml_dtypes).
_SUPPORTED = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.uint8,
    torch.int8, torch.int16, torch.int32, torch.int64,
    *(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)),
})


def check_tensor(tensor: Any, what: str, name: str | None) -> torch.Tensor:
    """Return ``tensor`` or raise a ConfigError saying why it cannot be sent."""
    if sendable(tensor):
        return tensor
    raise _refusal(tensor, f"{what}" + (f" {name!r}" if name else ""))


def sendable(tensor: Any) -> bool:
    """Whether ``check_tensor`` accepts ``tensor``: the few attribute reads alone (about
    1 us; a grouped call checks every tensor of a model's gradients on every step)."""
    return (isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided
            and tensor.dtype in _SUPPORTED and not tensor.is_quantized
            and not tensor.is_meta and not tensor.is_neg() and not tensor.is_conj())


def _refusal(tensor: Any, label: str) -> ConfigError:
    """Why ``sendable`` refused ``tensor``, and what to send instead."""
    if not isinstance(tensor, torch.Tensor):
        return ConfigError(f"{label} expects a torch.Tensor, got {type(tensor).__name__}; "
                           "convert it first with torch.as_tensor(...)")
    if tensor.layout != torch.strided:
        return ConfigError(f"{label}: {tensor.layout} tensors are not supported; call "
                           ".to_dense()")
    if tensor.dtype in _COMPLEX:
        return ConfigError(f"{label}: dtype {tensor.dtype} is not supported; send "
                           "torch.view_as_real(t) instead")
    if tensor.is_quantized:
        return ConfigError(f"{label}: quantized tensors are not supported; send "
                           "t.dequantize() instead")
    if tensor.dtype not in _SUPPORTED:
        return ConfigError(f"{label}: dtype {tensor.dtype} is not supported; cast it first "
                           f"(e.g. t.float()); supported: {_supported_names()}")
    if tensor.is_meta:
        return ConfigError(f"{label}: a meta tensor has no data to send; materialize it first")
    return ConfigError(f"{label}: the tensor is a lazy negated/conjugated view; pass "
                       "t.resolve_neg() (or t.resolve_conj()) instead")


def _supported_names() -> str:
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in _SUPPORTED))


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array sharing the memory of a CPU tensor (any strides)."""
    t = tensor.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def from_numpy(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (copied to ``device`` when it is not the CPU)."""
    if array.dtype == BFLOAT16:
        t = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(array)
    return t if device.type == "cpu" else t.to(device)


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.device.type == "cpu" else tensor.detach().cpu()


def _single(fn: Callable[[Any], Any]) -> Callable[[list], Any]:
    return lambda results: fn(results[0])


def _in_place_target(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[Any], Any]]:
    """The CPU tensor the engine writes into, and what copies it back afterwards."""
    cpu = _cpu(tensor)
    if cpu is tensor:
        return cpu, lambda _: tensor

    def copy_back(_: Any) -> torch.Tensor:
        with torch.no_grad():
            tensor.copy_(cpu)
        return tensor

    return cpu, copy_back


_GLOBAL = C.global_process_set


def checked_tensor(tensor: Any, what: str, kind: str, name: str | None,
             process_set: C.ProcessSet) -> torch.Tensor:
    """``check_tensor``, but a failure is also reported to the other ranks.

    Their copy of the operation then fails too instead of waiting, and this rank's
    automatic name is used up as theirs is, so later unnamed calls still match.
    """
    if sendable(tensor):  # (check_tensor's test, one call fewer on every call)
        return tensor
    try:
        return check_tensor(tensor, what, name)
    except ConfigError as exc:
        if C.is_initialized() and (process_set is _GLOBAL or process_set.included()):
            _plumbing.report_failure(kind, _plumbing.auto_name(kind, name, process_set), exc,
                                     process_set.members())
        raise


def allreduce_async(
    tensor: torch.Tensor, name: str | None, op: ReduceOp,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: C.ProcessSet = _GLOBAL,
) -> TorchHandle:
    """Start an out-of-place allreduce; the result is a new tensor on ``tensor``'s device."""
    checked_tensor(tensor, "allreduce", "allreduce", name, process_set)
    if tensor.is_cuda:
        from hvd_spark.torch import device_path

        if device_path.usable([tensor], op):  # NCCL / CUDA IPC: no host copy
            return device_path.allreduce_async(tensor, name, op, prescale_factor,
                                               postscale_factor, process_set, in_place=False)
    handle = C.allreduce_async(as_numpy(_cpu(tensor)), name, op, prescale_factor,
                               postscale_factor, process_set)
    return TorchHandle([handle], _single(lambda r: from_numpy(r, tensor.device)))


def allreduce_async_(
    tensor: torch.Tensor, name: str | None, op: ReduceOp,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: C.ProcessSet = _GLOBAL,
) -> TorchHandle:
    """Start an in-place allreduce: ``tensor`` receives the result (no copy on CPU)."""
    checked_tensor(tensor, "allreduce_", "allreduce", name, process_set)
    if tensor.is_cuda:
        from hvd_spark.torch import device_path

        if device_path.usable([tensor], op):
            return device_path.allreduce_async(tensor, name, op, prescale_factor,
                                               postscale_factor, process_set, in_place=True)
    cpu, finish = _in_place_target(tensor)
    handle = C.allreduce_async_(as_numpy(cpu), name, op, prescale_factor, postscale_factor,
                                process_set)
    return TorchHandle([handle], _single(finish))


def allreduce(
    tensor: torch.Tensor, name: str | None, op: ReduceOp,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: C.ProcessSet = _GLOBAL,
) -> torch.Tensor:
    """Allreduce and wait: a new tensor on ``tensor``'s device.

    A CPU tensor takes the numpy API's synchronous call, not an async handle waited at
    once: that call may carry a larger tensor with its negotiation (its caller is known
    to wait alone) and take the MPI backend's express path.
    """
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:  # (checked by allreduce_async)
        return allreduce_async(tensor, name, op, prescale_factor, postscale_factor,
                               process_set).wait()
    checked_tensor(tensor, "allreduce", "allreduce", name, process_set)
    result = C.allreduce(as_numpy(_cpu(tensor)), name, op, prescale_factor,
                         postscale_factor, process_set)
    return from_numpy(result, tensor.device)


def allreduce_(
    tensor: torch.Tensor, name: str | None, op: ReduceOp,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: C.ProcessSet = _GLOBAL,
) -> torch.Tensor:
    """In-place allreduce and wait (see ``allreduce``); returns ``tensor``."""
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:  # (checked by allreduce_async_)
        return allreduce_async_(tensor, name, op, prescale_factor, postscale_factor,
                                process_set).wait()
    checked_tensor(tensor, "allreduce_", "allreduce", name, process_set)
    cpu = _cpu(tensor)
    C.allreduce_(as_numpy(cpu), name, op, prescale_factor, postscale_factor, process_set)
    if cpu is not tensor:  # (as _in_place_target's copy back)
        with torch.no_grad():
            tensor.copy_(cpu)
    return tensor


def allreduce_many_async_(
    tensors: Sequence[torch.Tensor], names: Sequence[str], op: ReduceOp,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: C.ProcessSet = _GLOBAL,
) -> list[TorchHandle]:
    """Start in-place allreduces of named tensors in one batch: one request message, each
    tensor still matched across ranks by its own name."""
    targets = []
    for tensor, name in zip(tensors, names):
        check_tensor(tensor, "allreduce_", name)
        targets.append(_in_place_target(tensor))
    handles = C.allreduce_many_async_([as_numpy(cpu) for cpu, _ in targets], names, op,
                                      prescale_factor, postscale_factor, process_set)
    return [TorchHandle([h], _single(finish)) for h, (_, finish) in zip(handles, targets)]


def _check_group(kind: str, tensors: Any) -> None:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise ConfigError(f"grouped_{kind} expects a list of tensors")


def group_base(kind: str, tensors: Any, name: str | None, process_set: C.ProcessSet) -> str:
    """A group's base name for its tensors' own calls (``<base>.<i>``), numbered as the
    numpy grouped calls are (so unnamed groups of the two never share a name)."""
    _check_group(kind, tensors)
    return _plumbing.group_base_name(kind, name, process_set)


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor], name: str | None, op: ReduceOp,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0, in_place: bool = False,
    process_set: C.ProcessSet = _GLOBAL,
) -> TorchHandle:
    """Start allreduces of several tensors that the engine fuses; one handle for all.

    CPU tensors go through the numpy grouped call: one packed request for the group (see
    ``collectives.packing``). A group with a CUDA tensor goes tensor by tensor.
    """
    _check_group("allreduce", tensors)
    if not any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return _grouped_allreduce_host(tensors, name, op, prescale_factor, postscale_factor,
                                       in_place, process_set)
    base = group_base("allreduce", tensors, name, process_set)
    start = allreduce_async_ if in_place else allreduce_async
    parts = [start(t, f"{base}.{i}", op, prescale_factor, postscale_factor, process_set)
             for i, t in enumerate(tensors)]
    inner = [h for p in parts for h in p.inner]
    return TorchHandle(inner, lambda _: [p.wait() for p in parts])


def check_grouped_allreduce(tensors: Sequence[Any], name: str | None,
                            process_set: C.ProcessSet = _GLOBAL) -> None:
    """``check_tensor`` for each tensor of a grouped allreduce; a failure is also reported
    to the other ranks (as the grouped call's, so theirs fails at once instead of waiting)."""
    _check_group("allreduce", tensors)
    try:
        for i, tensor in enumerate(tensors):
            if not sendable(tensor):  # the label only for a refusal (a step checks 161)
                check_tensor(tensor, "grouped_allreduce", f"{name or 'grouped_allreduce'}[{i}]")
    except ConfigError as exc:
        if C.is_initialized() and (process_set is _GLOBAL or process_set.included()):
            _plumbing.report_grouped_failure("allreduce", len(tensors), name, exc, process_set)
        raise


def _grouped_allreduce_host(
    tensors: Sequence[torch.Tensor], name: str | None, op: ReduceOp, prescale_factor: float,
    postscale_factor: float, in_place: bool, process_set: C.ProcessSet,
) -> TorchHandle:
    """A grouped allreduce of CPU tensors as the numpy API's single grouped call."""
    check_grouped_allreduce(tensors, name, process_set)
    if in_place:
        targets = [_in_place_target(t) for t in tensors]
        handles = C.grouped_allreduce_async_([as_numpy(cpu) for cpu, _ in targets], name, op,
                                             prescale_factor, postscale_factor, process_set)
        return TorchHandle(handles, lambda _: [finish(None) for _, finish in targets])
    handles = C.grouped_allreduce_async([as_numpy(_cpu(t)) for t in tensors], name, op,
                                        prescale_factor, postscale_factor, process_set)
    return TorchHandle(handles, lambda results: [from_numpy(r, t.device)
                                                 for r, t in zip(results, tensors)])


def allgather_async(tensor: torch.Tensor, name: str | None,
                    process_set: C.ProcessSet = _GLOBAL) -> TorchHandle:
    """Start concatenating every rank's tensor along dim 0."""
    checked_tensor(tensor, "allgather", "allgather", name, process_set)
    if tensor.is_cuda:
        from hvd_spark.torch import device_path

        if device_path.usable([tensor]):
            return device_path.allgather_async(tensor, name, process_set)
    handle = C.allgather_async(as_numpy(_cpu(tensor)), name, process_set)
    return TorchHandle([handle], _single(lambda r: from_numpy(r, tensor.device)))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None,
                            process_set: C.ProcessSet = _GLOBAL) -> TorchHandle:
    """Start allgathers of several tensors; one handle whose result is a list."""
    base = group_base("allgather", tensors, name, process_set)
    parts = [allgather_async(t, f"{base}.{i}", process_set) for i, t in enumerate(tensors)]
    return TorchHandle([h for p in parts for h in p.inner], lambda _: [p.wait() for p in parts])


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None,
                    process_set: C.ProcessSet = _GLOBAL) -> TorchHandle:
    """Start broadcasting root's tensor; the result is a new tensor."""
    checked_tensor(tensor, "broadcast", "broadcast", name, process_set)
    if tensor.is_cuda:
        from hvd_spark.torch import device_path

        if device_path.usable([tensor]):
            return device_path.broadcast_async(tensor, root_rank, name, process_set,
                                               in_place=False)
    handle = C.broadcast_async(as_numpy(_cpu(tensor)), root_rank, name, process_set)
    return TorchHandle([handle], _single(lambda r: from_numpy(r, tensor.device)))


def allgather(tensor: torch.Tensor, name: str | None,
              process_set: C.ProcessSet = _GLOBAL) -> torch.Tensor:
    """Allgather and wait, for a tensor the caller checked (``checked_tensor``): a CPU
    tensor takes the numpy API's synchronous call, which two ranks may run on their
    express path (see ``allreduce``)."""
    if tensor.is_cuda:
        return allgather_async(tensor, name, process_set).wait()
    return from_numpy(C.allgather(as_numpy(_cpu(tensor)), name, process_set), tensor.device)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None,
              process_set: C.ProcessSet = _GLOBAL) -> torch.Tensor:
    """Broadcast and wait, for a tensor the caller checked: a new tensor (a CPU one by
    the numpy API's synchronous call, as ``allgather``)."""
    if tensor.is_cuda:
        return broadcast_async(tensor, root_rank, name, process_set).wait()
    return from_numpy(C.broadcast(as_numpy(_cpu(tensor)), root_rank, name, process_set),
                      tensor.device)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None,
               process_set: C.ProcessSet = _GLOBAL) -> torch.Tensor:
    """In-place broadcast and wait (as ``broadcast``); returns ``tensor``."""
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:  # (checked by the async call)
        return broadcast_async_(tensor, root_rank, name, process_set).wait()
    checked_tensor(tensor, "broadcast_", "broadcast", name, process_set)
    cpu = _cpu(tensor)
    C.broadcast_(as_numpy(cpu), root_rank, name, process_set)
    if cpu is not tensor:  # (as allreduce_)
        with torch.no_grad():
            tensor.copy_(cpu)
    return tensor


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None,
                     process_set: C.ProcessSet = _GLOBAL) -> TorchHandle:
    """Start an in-place broadcast into ``tensor``."""
    checked_tensor(tensor, "broadcast_", "broadcast", name, process_set)
    if tensor.is_cuda:
        from hvd_spark.torch import device_path

        if device_path.usable([tensor]):
            return device_path.broadcast_async(tensor, root_rank, name, process_set,
                                               in_place=True)
    cpu, finish = _in_place_target(tensor)
    handle = C.broadcast_async_(as_numpy(cpu), root_rank, name, process_set)
    return TorchHandle([handle], _single(finish))


def alltoall_async(
    tensor: torch.Tensor, splits: Any, name: str | None, process_set: C.ProcessSet = _GLOBAL,
) -> TorchHandle:
    """Start an alltoall; the result is ``(tensor, received_splits)``."""
    checked_tensor(tensor, "alltoall", "alltoall", name, process_set)
    if isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu().numpy()
    handle = C.alltoall_async(as_numpy(_cpu(tensor)), splits, name, process_set)

    def finish(result: tuple[np.ndarray, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = result
        return from_numpy(out, tensor.device), torch.from_numpy(received).to(torch.int32)

    return TorchHandle([handle], _single(finish))


def reducescatter_async(
    tensor: torch.Tensor, name: str | None, op: ReduceOp,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: C.ProcessSet = _GLOBAL,
) -> TorchHandle:
    """Start a reduce-scatter: reduce across ranks, keep this rank's block of dim-0 rows."""
    checked_tensor(tensor, "reducescatter", "reducescatter", name, process_set)
    handle = C.reducescatter_async(
        as_numpy(_cpu(tensor)), name, op, prescale_factor, postscale_factor, process_set)
    return TorchHandle([handle], _single(lambda r: from_numpy(r, tensor.device)))


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor], name: str | None, op: ReduceOp,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
    process_set: C.ProcessSet = _GLOBAL,
) -> TorchHandle:
    """Start reduce-scatters of several tensors; one handle whose result is a list."""
    base = group_base("reducescatter", tensors, name, process_set)
    parts = [reducescatter_async(t, f"{base}.{i}", op, prescale_factor, postscale_factor,
                                 process_set) for i, t in enumerate(tensors)]
    return TorchHandle([h for p in parts for h in p.inner], lambda _: [p.wait() for p in parts])
