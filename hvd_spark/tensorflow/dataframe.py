"""``dataframe_dataset``: a ``tf.data.Dataset`` over this rank's share of ``run(fn, df=...)``.

Each pass over the dataset (each Keras epoch) is the share's next epoch, reshuffled, with the
same number of batches on every rank (``hvd_spark.data.rank_share``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from hvd_spark.data.rank_share import RankShare


def dataframe_dataset(batch_size: int, *, shuffle: bool = True, seed: int = 0,
                      float_dtype: Any = np.float32) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of dicts ``column -> tensor`` over this rank's rows of the
    DataFrame given to ``hvd_spark.run(fn, df=...)``.

    Integers are int64, floats ``float_dtype`` (float32), arrays and ML Vectors
    ``(batch, length)``. Its cardinality is the batches of one epoch, equal on every rank.

    Args:
        batch_size: Rows per batch on this rank.
        shuffle: Reshuffle the rows every epoch (seeded by ``seed``, the epoch and the rank).
        seed: The shuffle's seed.
        float_dtype: dtype of floating-point columns (numpy's); None keeps them as written.

    Raises:
        ConfigError: Not in a rank of a run with ``df=``, or a bad ``batch_size``.
    """
    share = RankShare.current()
    steps = share.steps_per_epoch(batch_size)
    first = next(share.epoch(0, batch_size, shuffle=False, float_dtype=float_dtype))
    signature = {name: tf.TensorSpec((None, *array.shape[1:]), tf.as_dtype(array.dtype))
                 for name, array in first.items()}
    epochs = itertools.count()

    def one_epoch() -> Iterator[dict[str, np.ndarray]]:
        yield from share.epoch(next(epochs), batch_size, shuffle=shuffle, seed=seed,
                               float_dtype=float_dtype)

    dataset = tf.data.Dataset.from_generator(one_epoch, output_signature=signature)
    return dataset.apply(tf.data.experimental.assert_cardinality(steps))
