"""Make every rank start from the same model and optimizer state, and object collectives."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from hvd_spark import collectives as C
from hvd_spark.errors import ConfigError
from hvd_spark.torch import half_kernels
from hvd_spark.torch import tensor_ops as T


def init(comm: Any = None, process_sets: Sequence[C.ProcessSet] | None = None) -> None:
    """Join the job (a one-rank job without a launcher); safe to call more than once.

    The first call also lends torch's vectorised float16/bfloat16 kernels to the
    collectives (``half_kernels.register_once``): numpy's half conversions are scalar;
    the rounding is the same, so the results are bitwise the same.
    """
    half_kernels.register_once()
    C.init(comm, process_sets=process_sets)


def broadcast_parameters(
    params: Mapping[str, Any] | Iterable[tuple[str, Any]], root_rank: int = 0
) -> None:
    """Overwrite every rank's tensors in place with ``root_rank``'s.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()`` (names must be
            the same on all ranks). Non-tensor entries are ignored.
        root_rank: The rank whose values everyone gets.
    """
    if isinstance(params, Mapping):
        items = sorted(params.items())
    else:
        items = list(params)
        if any(not (isinstance(x, tuple) and len(x) == 2) for x in items):
            raise ConfigError(
                "broadcast_parameters expects a state_dict or (name, tensor) pairs such as "
                "model.named_parameters()")
    handles = [T.broadcast_async_(t, root_rank, f"broadcast.{name}")
               for name, t in items if isinstance(t, torch.Tensor)]
    for handle in handles:
        handle.wait()


def _skeleton(state_dict: dict) -> dict:
    """The optimizer state with tensors replaced by (shape, dtype) descriptions."""
    state = {
        idx: {key: ("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor)
              else ("value", v) for key, v in entry.items()}
        for idx, entry in state_dict["state"].items()
    }
    return {"state": state, "param_groups": state_dict["param_groups"]}


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyper-parameters.

    Unlike Horovod, no dummy optimizer step is run to create lazily-initialized
    state (e.g. Adam's moments before the first step): the root describes its
    state and the other ranks allocate matching tensors, so the parameters and
    the step count are never touched. When the root has no state yet, every rank
    ends up with none, exactly like a freshly created optimizer.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"broadcast_optimizer_state expects a torch optimizer, got {type(optimizer).__name__}")
    local = optimizer.state_dict()
    if not local["state"]:
        # As Horovod: parameters that will train get zero gradients, so code reading
        # ``p.grad`` right after the broadcast finds tensors (parameters are untouched).
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    skeleton = C.broadcast_object(
        _skeleton(local) if C.rank() == root_rank else None, root_rank,
        "broadcast_optimizer_state.skeleton")
    if len(skeleton["param_groups"]) != len(local["param_groups"]):
        raise ConfigError(
            f"rank {root_rank}'s optimizer has {len(skeleton['param_groups'])} parameter "
            f"group(s), this rank's has {len(local['param_groups'])}; build the same "
            "optimizer on every rank")
    state: dict = {}
    handles = []
    for idx in sorted(skeleton["state"]):
        entry = {}
        for key, desc in sorted(skeleton["state"][idx].items()):
            if desc[0] == "value":
                entry[key] = desc[1]
                continue
            _, shape, dtype = desc
            mine = local["state"].get(idx, {}).get(key)
            if not (isinstance(mine, torch.Tensor) and tuple(mine.shape) == shape
                    and mine.dtype == dtype):
                mine = torch.zeros(shape, dtype=dtype)
            handles.append(T.broadcast_async_(mine, root_rank, f"optimizer_state.{idx}.{key}"))
            entry[key] = mine
        state[idx] = entry
    for handle in handles:
        handle.wait()
    # Root's hyper-parameters (lr, betas, ...) with this rank's parameter indices.
    groups = [{**root, "params": mine["params"]}
              for root, mine in zip(skeleton["param_groups"], local["param_groups"], strict=True)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str | None = None,
                     process_set: C.ProcessSet = C.global_process_set) -> Any:
    """Return ``root_rank``'s picklable ``obj`` on every rank (of ``process_set``)."""
    return C.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: C.ProcessSet = C.global_process_set) -> list[Any]:
    """Return every rank's picklable ``obj``, in rank order."""
    return C.allgather_object(obj, name, process_set)
