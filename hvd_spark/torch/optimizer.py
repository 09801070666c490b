"""DistributedOptimizer: averages gradients across ranks while backward() still runs.

A post-accumulate-grad hook on every parameter starts an asynchronous in-place
allreduce of its gradient as soon as autograd has finished it, so communication
overlaps the rest of the backward pass (the engine fuses gradients that become
ready together). ``step()`` waits for them, then runs the wrapped optimizer.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hvd_spark import collectives as C
from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.errors import ConfigError
from hvd_spark.torch import device_path
from hvd_spark.torch import tensor_ops as T
from hvd_spark.torch.compression import Compression, Compressor
from hvd_spark.torch.cuda_staging import CudaStager
from hvd_spark.torch.handles import TorchHandle

log = logging.getLogger(__name__)

# Ready gradients are submitted together once they add up to this many bytes (or at
# synchronize): one engine cycle per bucket instead of one per small tensor, while
# large gradients still start at once and overlap the rest of backward().
BUCKET_BYTES = 1 << 20


def _param_names(optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None) -> dict:
    """Map every optimized parameter to a name that is the same on all ranks."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{g}.{i}"
                for g, group in enumerate(optimizer.param_groups)
                for i, p in enumerate(group["params"])}
    pairs = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in pairs):
        raise ConfigError(
            "named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()")
    seen: dict[str, int] = {}
    for name, _ in pairs:
        seen[name] = seen.get(name, 0) + 1
    dups = sorted(n for n, c in seen.items() if c > 1)
    if dups:
        raise ConfigError(
            f"named_parameters has duplicate names {dups}; allreduce matches gradients across "
            "ranks by name, so each parameter needs a unique one")
    names = {p: n for n, p in pairs}
    unnamed = [i for group in optimizer.param_groups for i, p in enumerate(group["params"])
               if p not in names]
    if unnamed:
        raise ConfigError(
            f"{len(unnamed)} optimizer parameter(s) are missing from named_parameters; pass "
            "the named_parameters() of the model whose parameters the optimizer updates")
    return names


class _DistributedOptimizer:
    """Mixin placed before the wrapped optimizer's class (see ``DistributedOptimizer``)."""

    def _hvd_setup(self, names: dict, compression: type[Compressor], passes: int,
                   op: ReduceOp, predivide: float, groups: list[list[torch.Tensor]],
                   sparse_as_dense: bool, process_set: C.ProcessSet) -> None:
        self._hvd_names = names
        self._hvd_process_set = process_set
        self._hvd_sparse_as_dense = sparse_as_dense
        # Parameter -> its group (a list), for gradients that must go out together.
        self._hvd_group_of = {p: g for g in groups for p in g}
        self._hvd_resparse: set = set()
        self._hvd_group_ready: dict[int, set] = {}
        self._hvd_compression = compression
        self._hvd_passes_per_step = passes
        self._hvd_op = op
        if op == ReduceOp.Average:
            self._hvd_scale = (1.0 / predivide, predivide)
        else:
            self._hvd_scale = (1.0, 1.0)
        self._hvd_params = [p for group in self.param_groups for p in group["params"]
                            if p.requires_grad]
        self._hvd_passes: dict[torch.Tensor, int] = {}
        self._hvd_handles: dict[torch.Tensor, tuple] = {}
        self._hvd_bucket: dict[torch.Tensor, None] = {}  # ordered set (tensors hash by id)
        self._hvd_bucket_bytes = 0
        self._hvd_stager: CudaStager | None = None  # made at the first CUDA gradient
        self._hvd_synchronized = False
        self._hvd_should_sync = True
        # A rank outside the process set trains alone, as in Horovod: no hooks, no averaging.
        self._hvd_member = process_set.included() is not False
        self._hvd_hooks = [p.register_post_accumulate_grad_hook(self._hvd_on_grad)
                           for p in self._hvd_params] if self._hvd_member else []

    def _hvd_on_grad(self, p: torch.Tensor) -> None:
        if p in self._hvd_handles or p in self._hvd_bucket:
            raise ConfigError(
                f"the gradient of {self._hvd_names[p]!r} was computed more than "
                f"backward_passes_per_step={self._hvd_passes_per_step} time(s) before step(); "
                "call step() or synchronize() after that many backward() calls, or raise "
                "backward_passes_per_step")
        count = self._hvd_passes.get(p, 0) + 1
        self._hvd_passes[p] = count
        if count >= self._hvd_passes_per_step:
            group = self._hvd_group_of.get(p)
            if group is not None:
                ready = self._hvd_group_ready.setdefault(id(group), set())
                ready.add(p)
                if len(ready) == len(group):  # the whole group goes out in one batch
                    del self._hvd_group_ready[id(group)]
                    self._hvd_start(list(group))
                return
            self._hvd_bucket[p] = None
            self._hvd_bucket_bytes += p.numel() * p.element_size()
            if self._hvd_bucket_bytes >= BUCKET_BYTES:
                self._hvd_flush()

    def _hvd_flush(self) -> None:
        bucket, self._hvd_bucket, self._hvd_bucket_bytes = self._hvd_bucket, {}, 0
        self._hvd_start(list(bucket))

    def _hvd_start(self, params: list[torch.Tensor]) -> None:
        prescale, postscale = self._hvd_scale
        by_device: dict[torch.device, list] = {}
        for p in params:
            if p.grad is None:
                # Unused on this rank but maybe not on others: contribute zeros (as Horovod).
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse:
                if not self._hvd_sparse_as_dense:
                    self._hvd_handles[p] = (self._hvd_sparse(p), p.grad, None, None)
                    continue
                p.grad = p.grad.to_dense()
                self._hvd_resparse.add(p)  # the optimizer expects it sparse again (SparseAdam)
            grad = p.grad
            wire, ctx = self._hvd_compression.compress(grad)
            name = f"allreduce.{self._hvd_names[p]}"
            by_device.setdefault(wire.device, []).append((p, grad, wire, ctx, name))
        # One request message per bucket; each gradient keeps its own name, so ranks whose
        # buckets differ still match every gradient.
        cpu_items = by_device.pop(torch.device("cpu"), [])
        if cpu_items:
            handles = T.allreduce_many_async_(
                [wire for _, _, wire, _, _ in cpu_items], [n for *_, n in cpu_items],
                self._hvd_op, prescale, postscale, self._hvd_process_set)
            for handle, (p, grad, wire, ctx, _) in zip(handles, cpu_items):
                self._hvd_handles[p] = (handle, grad, wire, ctx)
        for items in by_device.values():
            if device_path.usable([wire for _, _, wire, _, _ in items], self._hvd_op):
                # NCCL / CUDA IPC: the gradients never leave the GPU.
                handles = device_path.allreduce_many_async_(
                    [wire for _, _, wire, _, _ in items], [n for *_, n in items],
                    self._hvd_op, prescale, postscale, self._hvd_process_set)
                for handle, (p, grad, wire, ctx, _) in zip(handles, items):
                    self._hvd_handles[p] = (handle, grad, wire, ctx)
                continue
            if self._hvd_stager is None:
                self._hvd_stager = CudaStager()
            handles = self._hvd_stager.allreduce_async_(
                [(p, wire, name) for p, _, wire, _, name in items], self._hvd_op,
                prescale, postscale, self._hvd_process_set)
            for handle, (p, grad, wire, ctx, _) in zip(handles, items):
                self._hvd_handles[p] = (handle, grad, wire, ctx)

    def _hvd_sparse(self, p: torch.Tensor) -> TorchHandle:
        """A sparse gradient (an embedding's): allgathered as indices and values."""
        from hvd_spark.torch.mpi_ops import sparse_allreduce_async

        op = ReduceOp.Sum if self._hvd_op == ReduceOp.Sum else ReduceOp.Average
        handle = sparse_allreduce_async(p.grad, f"allreduce.{self._hvd_names[p]}", op,
                                        self._hvd_process_set)

        def finish(_: list) -> torch.Tensor:
            p.grad = handle.wait()
            return p.grad

        return TorchHandle(handle.inner, finish)

    @property
    def _parameter_names(self) -> dict:
        """Parameter -> the name its gradient is matched by (Horovod's attribute)."""
        return self._hvd_names

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated before each allreduce."""
        if not isinstance(passes, int) or passes < 1:
            raise ConfigError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
        self._hvd_passes_per_step = passes

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce (starting those whose hook has not fired).

        Parameters no rank-local backward reached get zero gradients, so that ranks
        which did use them are not left waiting.
        """
        if not self._hvd_member:
            self._hvd_synchronized = True
            return
        self._hvd_flush()
        self._hvd_group_ready.clear()
        self._hvd_start([p for p in self._hvd_params if p not in self._hvd_handles])
        try:
            for handle, grad, wire, ctx in self._hvd_handles.values():
                handle.wait()
                if wire is not None and wire is not grad:
                    with torch.no_grad():
                        grad.copy_(self._hvd_compression.decompress(wire, ctx))
            for p in self._hvd_resparse:
                p.grad = p.grad.to_sparse()
        finally:
            self._hvd_resparse.clear()
            self._hvd_handles.clear()
            self._hvd_passes.clear()
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize (call ``synchronize()`` first)."""
        self._hvd_should_sync = False
        try:
            yield
        finally:
            self._hvd_should_sync = True

    def step(self, closure: Any = None) -> Any:
        """Average the gradients across ranks (unless already done), then step."""
        if self._hvd_should_sync and not self._hvd_synchronized:
            self.synchronize()
        elif self._hvd_should_sync:
            warnings.warn(
                "optimizer.step() called without optimizer.skip_synchronize() context after "
                "optimizer.synchronize(); the gradients were already averaged, so step() does "
                "not average them again. Wrap step() in `with optimizer.skip_synchronize():` "
                "to say so explicitly.", stacklevel=2)
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; refused while their allreduces are still running."""
        if self._hvd_handles or self._hvd_bucket:
            raise ConfigError(
                "zero_grad() was called after backward() but before step() or synchronize(): "
                "the gradients are still being averaged; call step() (or synchronize()) first")
        super().zero_grad(set_to_none)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (e.g. before wrapping the parameters again)."""
        for hook in self._hvd_hooks:
            hook.remove()
        self._hvd_hooks = []
        if self._hvd_stager is not None:  # its helper thread and pinned buffers go too
            self._hvd_stager.close()
            self._hvd_stager = None


def _grad_groups(optimizer: torch.optim.Optimizer, num_groups: int,
                 groups: int | list | None) -> list[list[torch.Tensor]]:
    """Horovod's ``num_groups``/``groups`` as lists of parameters submitted together."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if isinstance(groups, int) and not isinstance(groups, bool):
        num_groups, groups = groups, None
    if groups is not None:
        if num_groups:
            raise ConfigError("pass either num_groups or groups to DistributedOptimizer, not both")
        if not isinstance(groups, (list, tuple)) or any(
                not isinstance(g, (list, tuple)) for g in groups):
            raise ConfigError("groups must be a list of lists of parameters (or an int)")
        known = {id(p) for p in params}
        out = [list(g) for g in groups]
        if any(id(p) not in known for g in out for p in g):
            raise ConfigError("groups names a parameter the optimizer does not train")
        return [g for g in out if g]
    if not isinstance(num_groups, int) or num_groups < 0:
        raise ConfigError(f"num_groups must be an integer >= 0, got {num_groups!r}")
    if num_groups == 0:
        return []
    size = -(-len(params) // num_groups)
    return [params[i : i + size] for i in range(0, len(params), size)]


_classes: dict[type, type] = {}


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp = ReduceOp.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | list[list[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: C.ProcessSet = C.global_process_set,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks.

    The result is an instance of a subclass of ``type(optimizer)`` sharing its
    parameter groups, state and hooks (so ``isinstance`` checks, LR schedulers and
    ``state_dict`` keep working); use it instead of the original.

    Args:
        optimizer: Any torch optimizer.
        named_parameters: ``model.named_parameters()``; names tie gradients together
            across ranks and appear in error messages. Without it, names come from
            positions in the parameter groups (identical models give identical names).
        compression: ``Compression.none``, ``.fp16`` or ``.bf16`` on the wire.
        backward_passes_per_step: Backward passes accumulated locally before each
            allreduce (scale the loss by 1/k to average them).
        op: ``Average`` or ``Sum`` over ranks.
        gradient_predivide_factor: With Average, divide by this before the sum and by
            ``size / factor`` after (guards float16 against overflow).
        num_groups: Split the parameters, in order, into this many groups; each group's
            gradients are submitted together once all are ready (0: no groups).
        groups: Instead, an explicit list of parameter lists (or an int, as num_groups).
        sparse_as_dense: Densify sparse gradients (embeddings) and allreduce them; else
            they are allgathered as indices and values.
        process_set: Average over this process set's ranks only.

    Raises:
        ConfigError: Duplicate or missing names, or a bad argument.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ConfigError("this optimizer is already a DistributedOptimizer; wrap it only once")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ConfigError(
            f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ConfigError(f"op={op!r} is not supported; use Average or Sum") from None
    if op not in (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum):
        raise ConfigError(
            f"DistributedOptimizer reduces gradients with Average, Sum or Adasum, not {op.name}")
    if gradient_predivide_factor <= 0:
        raise ConfigError(
            f"gradient_predivide_factor must be positive, got {gradient_predivide_factor}")
    if gradient_predivide_factor != 1.0 and op != ReduceOp.Average:
        raise ConfigError("gradient_predivide_factor only applies with op=Average")
    names = _param_names(optimizer, named_parameters)
    param_groups = _grad_groups(optimizer, num_groups, groups)
    base = type(optimizer)
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
        _classes[base] = cls
    # Adopt the existing optimizer's attributes instead of re-running its __init__,
    # which may need arguments we do not know and would drop existing state.
    dist = cls.__new__(cls)
    dist.__dict__.update(optimizer.__dict__)
    dist._hvd_setup(names, compression, backward_passes_per_step, op, gradient_predivide_factor,
                    param_groups, sparse_as_dense, process_set)
    return dist
