"""The training and validation rows of this rank's DataFrame share, read like the Store's shards.

The Estimators' direct path (``fit(df)`` without a Store) hands each rank its partition
of the DataFrame through its Spark task (``rank_share``), with one boolean column that
marks the validation rows. ``ShareSplitReader`` yields batches of one split with the
interface of ``reader.ShardReader`` (``rank``, ``batch_size``, ``steps_per_epoch``,
``epoch(e)``), so a worker trains the same way on both paths.

Equal steps on every rank: ``steps_per_epoch`` is the smallest rank's rows of the split
(``least_rows``, agreed on by the ranks) divided by the batch size. Each epoch draws
that many rows from the rank's own rows, in a fresh order when shuffling (seeded by the
seed, the epoch and the rank); asking for more steps than that reads the rows again.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from hvd_spark.data.rank_share import RankShare
from hvd_spark.errors import DataError

Batch = dict[str, np.ndarray]


def split_rows(share: RankShare, marker: str) -> tuple[np.ndarray, np.ndarray]:
    """``(train rows, validation rows)``: indices into ``share``, by its boolean ``marker``
    column (every row is a training row when the share has no such column)."""
    everything = np.arange(share.num_rows, dtype=np.int64)
    if marker not in share.columns:
        return everything, everything[:0]
    is_val = share.take(everything, [marker], float_dtype=None)[marker].astype(bool)
    return everything[~is_val], everything[is_val]


class ShareSplitReader:
    """Batches of one split of this rank's share, the same number on every rank.

    Args:
        share: This rank's share.
        rows: The split's row indices in ``share``.
        least_rows: The smallest number of rows of this split on any rank.
        batch_size: Rows per batch.
        split: ``"train"`` or ``"val"`` (for messages).
        columns: The columns a batch holds.
        shuffle: A different order each epoch (seeded).
        seed: The shuffle's seed, the same on every rank.
        steps_per_epoch: Batches per epoch; default ``least_rows // batch_size``.

    Raises:
        DataError: The smallest rank's split cannot fill one batch.
    """

    def __init__(self, share: RankShare, rows: np.ndarray, least_rows: int, batch_size: int,
                 *, split: str, columns: Sequence[str], shuffle: bool, seed: int,
                 steps_per_epoch: int | None = None) -> None:
        natural = int(least_rows) // batch_size
        if natural == 0 and (steps_per_epoch is None or len(rows) == 0):
            raise DataError(
                f"split {split!r}: the smallest rank's share of the DataFrame holds "
                f"{least_rows} {split} rows, fewer than one batch of {batch_size}: use a "
                f"smaller batch size or fewer ranks, or more data (set store=... to share "
                "the rows out exactly instead)")
        self.rank = share.rank
        self.batch_size = batch_size
        self.steps_per_epoch = steps_per_epoch or natural
        self.num_rows = len(rows)
        self._share, self._rows = share, rows
        self._columns = list(columns)
        self._shuffle, self._seed = shuffle, int(seed)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def epoch(self, epoch: int = 0) -> Iterator[Batch]:
        """Exactly ``steps_per_epoch`` batches of ``epoch``, columns as written."""
        wanted = self.steps_per_epoch * self.batch_size
        passes = max(1, math.ceil(wanted / len(self._rows)))
        if self._shuffle:
            orders = [np.random.default_rng([self._seed, epoch, self.rank, p])
                      .permutation(self._rows) for p in range(passes)]
        else:
            orders = [self._rows] * passes
        order = np.concatenate(orders)[:wanted]
        for start in range(0, wanted, self.batch_size):
            yield self._share.take(order[start:start + self.batch_size], self._columns,
                                   float_dtype=None)
