"""A PyTorch Lightning 2.x ``Strategy`` over ``hvd_spark.torch``: one process per rank, gradients
averaged by hvd_spark's DistributedOptimizer (Lightning 2 dropped its Horovod strategy).

Works with both distributions of Lightning (``lightning.pytorch`` and ``pytorch_lightning``):
``strategy_class(pl)`` builds the class for the package the LightningModule comes from.
Usable without Spark, in any process where ``hvd_spark.torch.init()`` can join a ring
(``hvdrun``, ``run_local``, the Estimators' ranks)::

    trainer = pl.Trainer(strategy=strategy_class(pl)(), accelerator="cpu", devices=1, ...)

No pyspark here (an import contract): it runs in the ranks' processes.
"""

from __future__ import annotations

import contextlib
from typing import Any

_CLASSES: dict[str, type] = {}


def lightning_package(model: Any) -> str:
    """``"lightning.pytorch"`` or ``"pytorch_lightning"``: whose LightningModule ``model`` is."""
    for cls in type(model).__mro__:
        if cls.__name__ == "LightningModule":
            root = cls.__module__.split(".")[0]
            return "pytorch_lightning" if root == "pytorch_lightning" else "lightning.pytorch"
    return ""


def strategy_class(pl: Any) -> type:
    """The strategy class for the Lightning package module ``pl`` (built once per package)."""
    if pl.__name__ in _CLASSES:
        return _CLASSES[pl.__name__]
    import torch

    import hvd_spark.torch as hvd

    parallel = pl.strategies.ParallelStrategy
    base_teardown = pl.strategies.Strategy.teardown
    fitting = pl.trainer.states.TrainerFn.FITTING

    class HvdSparkStrategy(parallel):
        """Lightning strategy: rank, size and collectives from ``hvd_spark.torch``.

        Args:
            device: This rank's device (default: the CPU).
            compression: Gradient compression (``hvd.Compression.none`` or ``.fp16``).
        """

        strategy_name = "hvd_spark"

        def __init__(self, device: Any = None, compression: Any = None, **kwargs: Any) -> None:
            super().__init__(parallel_devices=[torch.device(device or "cpu")], **kwargs)
            self._compression = compression or hvd.Compression.none
            self._exit_stack: contextlib.ExitStack | None = None

        @property
        def root_device(self) -> Any:
            return self.parallel_devices[0]

        @property
        def global_rank(self) -> int:
            return hvd.rank()

        @property
        def local_rank(self) -> int:
            return hvd.local_rank()

        @property
        def node_rank(self) -> int:
            return hvd.cross_rank()

        @property
        def world_size(self) -> int:
            return hvd.size()

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            return {"num_replicas": hvd.size(), "rank": hvd.rank()}

        def setup_environment(self) -> None:
            hvd.init()
            # Progress, logging and checkpoint writing happen on rank 0 only.
            for module in ("lightning.fabric.utilities.rank_zero",
                           "lightning.pytorch.utilities.rank_zero",
                           "lightning_fabric.utilities.rank_zero",
                           "pytorch_lightning.utilities.rank_zero"):
                with contextlib.suppress(ImportError):
                    __import__(module, fromlist=["rank_zero_only"]).rank_zero_only.rank = \
                        hvd.rank()
            super().setup_environment()

        def model_to_device(self) -> None:
            if self.root_device.type == "cuda":
                torch.cuda.set_device(self.root_device)
            self.model.to(self.root_device)

        def setup(self, trainer: Any) -> None:
            super().setup(trainer)
            if trainer.state.fn != fitting:
                return
            module = self.lightning_module
            hvd.broadcast_parameters(module.state_dict(), root_rank=0)
            self._exit_stack = contextlib.ExitStack()
            wrapped = []
            for optimizer in self.optimizers:
                hvd.broadcast_optimizer_state(optimizer, root_rank=0)
                owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
                dist = hvd.DistributedOptimizer(
                    optimizer, compression=self._compression,
                    named_parameters=[(n, p) for n, p in module.named_parameters()
                                      if id(p) in owned])
                # The closure runs backward inside step(): gradients are averaged in
                # post_backward, so step() must not wait for them a second time.
                self._exit_stack.enter_context(dist.skip_synchronize())
                wrapped.append(dist)
            self.optimizers = wrapped

        def post_backward(self, closure_loss: Any) -> None:
            # Averaging partial sums every backward pass is exact (it is linear), also
            # when Lightning accumulates gradients over several batches.
            for optimizer in self.optimizers:
                optimizer.synchronize()

        def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
            if not isinstance(tensor, torch.Tensor):
                return tensor
            name = str(reduce_op or "mean").lower()
            if "sum" in name:
                op = hvd.Sum
            elif "max" in name:
                op = hvd.Max
            elif "min" in name:
                op = hvd.Min
            else:
                op = hvd.Average
            result = hvd.allreduce(tensor.detach().float().cpu(), op=op)
            return result.to(tensor.device, tensor.dtype if tensor.is_floating_point() else
                             torch.float32)

        def barrier(self, name: str | None = None) -> None:
            hvd.barrier()

        def broadcast(self, obj: Any, src: int = 0) -> Any:
            return hvd.broadcast_object(obj, root_rank=src)

        def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
            gathered = hvd.allgather(tensor.detach().cpu().unsqueeze(0))
            return gathered.to(tensor.device)

        def teardown(self) -> None:
            if self._exit_stack is not None:
                self._exit_stack.close()
                self._exit_stack = None
            for optimizer in self.optimizers:
                if hasattr(optimizer, "remove_hooks"):
                    optimizer.remove_hooks()
            base_teardown(self)  # ParallelStrategy's needs a cluster environment: none here

    _CLASSES[pl.__name__] = HvdSparkStrategy
    return HvdSparkStrategy
