"""Elastic training for PyTorch (Horovod's ``hvd.elastic`` in ``horovod.torch``).

``TorchState(model=, optimizer=, **kwargs)`` keeps a model, its optimizer, any
:class:`ElasticSampler` and plain attributes (``epoch=0, batch=0``) across re-formed
rings; ``@hvd.elastic.run`` restores the last commit when a rank is lost and syncs from
rank 0 after every reset. ``ElasticSampler`` splits a dataset over the current ranks and,
after a reset, over the new ranks, without repeating the samples already processed in
the epoch.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sized
from typing import Any

import torch

from hvd_spark import collectives as C
from hvd_spark.collectives.elastic import ObjectState, State, run
from hvd_spark.errors import ConfigError
from hvd_spark.torch.functions import broadcast_optimizer_state, broadcast_parameters

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]


def _snapshot(value: Any, previous: Any = None) -> Any:
    """A copy of ``value`` (a state dict) that later in-place updates cannot change.

    Tensors are copied into the previous snapshot's tensors where shapes and dtypes match:
    a commit of a 25M-parameter model then costs one memcpy, not fresh allocations
    (whose page faults cost several times the copy).
    """
    if isinstance(value, torch.Tensor):
        if (isinstance(previous, torch.Tensor) and previous.shape == value.shape
                and previous.dtype == value.dtype and previous.device == value.device):
            return previous.copy_(value.detach())
        return value.detach().clone()
    if isinstance(value, dict):
        prev = previous if isinstance(previous, dict) else {}
        return {k: _snapshot(v, prev.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        prev = previous if isinstance(previous, type(value)) and len(previous) == len(value) \
            else [None] * len(value)
        return type(value)(_snapshot(v, p) for v, p in zip(value, prev))
    return copy.deepcopy(value)


class ElasticSampler(torch.utils.data.Sampler):
    """Shards a dataset over the ranks of the current ring; remembers what was processed.

    Call ``set_epoch(epoch)`` at the start of each epoch and ``record_batch(i, batch_size)``
    after each batch; a ``TorchState`` holding the sampler commits, restores and syncs
    that record, so after a reset the remaining samples of the epoch are split over the
    new ranks.

    Args:
        dataset: A sized dataset.
        shuffle: Shuffle the indices each epoch (the same permutation on every rank).
        seed: Seed of the shuffle; the epoch is added to it.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        if not hasattr(dataset, "__len__"):
            raise ConfigError("ElasticSampler needs a dataset with a length (__len__)")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: forget what was processed and reshuffle."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record that this rank processed its batch ``batch_idx`` of ``batch_size``."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: list[int]) -> None:
        """Record dataset indices this rank processed."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The dataset indices of this rank's batch ``batch_idx``."""
        mine = self._my_indices()
        return mine[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def state_dict(self) -> dict[str, Any]:
        """Epoch and processed indices (what a commit keeps)."""
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a saved ``state_dict`` and re-shard the rest of the epoch."""
        self.epoch = state["epoch"]
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Re-shard the epoch's unprocessed samples over the current ranks."""
        if C.is_initialized():
            self.num_replicas, self.rank = C.size(), C.rank()
        else:
            self.num_replicas, self.rank = 1, 0
        order = list(range(len(self.dataset)))
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(order), generator=generator).tolist()
        self.remaining_indices = [i for i in order if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def _my_indices(self) -> list[int]:
        indices = list(self.remaining_indices)
        if indices and len(indices) < self.total_size:
            # Pad by repeating from the start so every rank runs the same number of steps.
            indices += (indices * math.ceil(self.total_size / len(indices)))[
                : self.total_size - len(indices)]
        return indices[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self._my_indices())

    def __len__(self) -> int:
        return self.num_samples


class TorchState(ObjectState):
    """A model, its optimizer, samplers and plain attributes that survive resets.

    Args:
        model: The ``torch.nn.Module`` (optional).
        optimizer: Its optimizer (optional).
        **kwargs: Plain attributes (``epoch=0, batch=0``) and :class:`ElasticSampler`
            objects; all become attributes of the state.
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self._samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        for name, sampler in self._samplers.items():
            setattr(self, name, sampler)
        plain = {k: v for k, v in kwargs.items() if k not in self._samplers}
        self._saved_model = _snapshot(model.state_dict()) if model is not None else None
        self._saved_optimizer = (_snapshot(optimizer.state_dict())
                                 if optimizer is not None else None)
        self._saved_samplers = {k: s.state_dict() for k, s in self._samplers.items()}
        super().__init__(**plain)

    def save(self) -> None:
        """Copy the model, optimizer and sampler states and the attributes."""
        if self.model is not None:
            self._saved_model = _snapshot(self.model.state_dict(), self._saved_model)
        if self.optimizer is not None:
            self._saved_optimizer = _snapshot(self.optimizer.state_dict(),
                                              self._saved_optimizer)
        self._saved_samplers = {k: s.state_dict() for k, s in self._samplers.items()}
        super().save()

    def restore(self) -> None:
        """Load the last saved states back."""
        if self.model is not None and self._saved_model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None and self._saved_optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        for name, sampler in self._samplers.items():
            sampler.load_state_dict(self._saved_samplers[name])
        super().restore()

    def sync(self) -> None:
        """Give every rank rank 0's model, optimizer and attributes; merge the samplers'
        processed indices over all ranks and re-shard them. The result is saved."""
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for name, sampler in self._samplers.items():
            states = C.allgather_object(sampler.state_dict(), name=f"elastic.sampler.{name}")
            merged = set().union(*(s["processed_indices"] for s in states))
            sampler.load_state_dict({"epoch": states[0]["epoch"],
                                     "processed_indices": sorted(merged)})
        super().sync()
        self.save()
