"""Data for torch: numpy batches as torch tensors, and ``Converter``'s torch loader.

``as_torch`` turns the batches of a ``hvd_spark.data.ShardReader`` into dicts of
``torch.Tensor``; ``TorchLoader`` is what ``Converter.make_torch_dataloader`` returns.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from hvd_spark.data.converter_loaders import BatchStream


def as_torch(batches: Iterable[dict[str, np.ndarray]], device: Any = None) -> Iterator[dict]:
    """Yield each batch as a dict of ``torch.Tensor`` (zero-copy on CPU where possible).

    Args:
        batches: Batches from ``ShardReader.epoch``.
        device: Optional torch device to move the tensors to (e.g. ``"cuda"``).
    """
    for batch in batches:
        out = {}
        for name, arr in batch.items():
            # Read-only arrays (zero-copy views of Arrow buffers) cannot back a tensor.
            tensor = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
            out[name] = tensor.to(device, non_blocking=True) if device is not None else tensor
        yield out


class TorchLoader:
    """Batches as dicts ``column -> torch.Tensor``: a context manager and an iterable.

    Integer columns are ``torch.int64``, floating-point ones the converter's dtype
    (``torch.float32`` by default); arrays have shape ``(batch_size, *shape)``.
    """

    def __init__(self, stream: BatchStream, device: Any = None) -> None:
        self._stream = stream
        self._device = device

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch, the same on every rank."""
        return self._stream.steps_per_epoch

    def __len__(self) -> int:
        return len(self._stream)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return as_torch(self._stream, self._device)

    def __enter__(self) -> TorchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the reading threads."""
        self._stream.close()
