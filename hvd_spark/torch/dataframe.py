"""``dataframe_loader``: a torch ``DataLoader`` over this rank's share of ``run(fn, df=...)``.

The share is on the executor's local disk (``hvd_spark.data.rank_share``); each pass over
the loader is one epoch, reshuffled, with the same number of batches on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from hvd_spark.data.rank_share import RankShare


class _Epochs(torch.utils.data.IterableDataset):
    """Each iteration is the share's next epoch, as batches of tensors."""

    def __init__(self, share: RankShare, batch_size: int, shuffle: bool, seed: int,
                 float_dtype: Any, device: Any) -> None:
        super().__init__()
        self.share, self.batch_size, self.shuffle, self.seed = share, batch_size, shuffle, seed
        self.float_dtype, self.device = float_dtype, device
        self.steps = share.steps_per_epoch(batch_size)
        self._next_epoch = 0

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        for batch in self.share.epoch(epoch, self.batch_size, shuffle=self.shuffle,
                                      seed=self.seed, float_dtype=self.float_dtype):
            out = {}
            for name, array in batch.items():
                # take() built these arrays for this batch: they back the tensors as they are.
                tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
                out[name] = tensor if self.device is None else tensor.to(self.device)
            yield out


def dataframe_loader(batch_size: int, *, shuffle: bool = True, seed: int = 0,
                     float_dtype: Any = np.float32, device: Any = None
                     ) -> torch.utils.data.DataLoader:
    """A ``DataLoader`` of dicts ``column -> tensor`` over this rank's rows of the DataFrame
    given to ``hvd_spark.run(fn, df=...)`` (or ``TorchDistributor.train_on_dataframe``).

    Integer columns are ``int64``, floating-point ones ``float_dtype`` (float32), arrays and
    ML Vectors ``(batch, length)``. Every ``for batch in loader`` is one epoch, reshuffled;
    ``len(loader)`` is its batches, equal on every rank (the smallest share decides).

    Args:
        batch_size: Rows per batch on this rank.
        shuffle: Reshuffle the rows every epoch (seeded by ``seed``, the epoch and the rank).
        seed: The shuffle's seed.
        float_dtype: dtype of floating-point columns (numpy's); None keeps them as written.
        device: Move each batch to this device (e.g. ``"cuda"``).

    Raises:
        ConfigError: Not in a rank of a run with ``df=``, or a bad ``batch_size``.
    """
    epochs = _Epochs(RankShare.current(), batch_size, shuffle, seed, float_dtype, device)
    return torch.utils.data.DataLoader(epochs, batch_size=None, num_workers=0)
