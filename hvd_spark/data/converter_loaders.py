"""What ``Converter.make_torch_dataloader`` / ``make_tf_dataset`` hand to a rank.

``BatchStream`` is the framework-neutral part: numpy batches of one shard over
``num_epochs`` epochs (``None``: forever, as in petastorm), read by a ``ShardReader``
and cast to the converter's dtypes. The framework bindings turn them into tensors:
``hvd_spark.torch.data.TorchLoader`` (dicts of torch tensors) and
``hvd_spark.tensorflow.data.TFDatasetContext`` (a ``tf.data.Dataset`` of dicts).

Equal steps per rank: every shard reads ``(rows // shard_count) // batch_size`` batches
per epoch (the reader's rule), whatever its share of rows, so ranks that run a
collective per batch never wait for one that has run out; the remainder (fewer than
``shard_count x (batch_size + 1)`` rows) is dropped, different rows each epoch when
shuffling.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np

from hvd_spark import _env
from hvd_spark.data.prefetch import Prefetcher
from hvd_spark.data.reader import ShardReader
from hvd_spark.data.shuffle import Batch
from hvd_spark.errors import ConfigError


def resolve_shard(cur_shard: int | None, shard_count: int | None) -> tuple[int, int]:
    """``(cur_shard, shard_count)``, defaulting to this rank's place in a ``run()`` job.

    Both ``None``: the rank and size the launcher set for this process
    (``HVD_SPARK_RANK``/``HVD_SPARK_SIZE``, what ``hvd.rank()``/``hvd.size()`` return),
    or ``(0, 1)`` outside a launcher (the whole data on the driver or in a notebook).

    Raises:
        ConfigError: Only one of them given, or values out of range.
    """
    if (cur_shard is None) != (shard_count is None):
        raise ConfigError(
            f"give both cur_shard and shard_count or neither, got cur_shard={cur_shard!r}, "
            f"shard_count={shard_count!r} (e.g. cur_shard=hvd.rank(), shard_count=hvd.size())")
    if cur_shard is None:
        rank, size = _env.get_int(_env.RANK, None), _env.get_int(_env.SIZE, None)
        return (0, 1) if rank is None or size is None else (rank, size)
    for name, value, lowest in (("shard_count", shard_count, 1), ("cur_shard", cur_shard, 0)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < lowest:
            raise ConfigError(f"{name} must be an int >= {lowest}, got {value!r}")
    if cur_shard >= shard_count:
        raise ConfigError(f"cur_shard must be < shard_count={shard_count}, got {cur_shard}")
    return int(cur_shard), int(shard_count)


def target_dtype(dtype: np.dtype, float_dtype: np.dtype | None) -> np.dtype:
    """The dtype a column is handed out as: integers as int64, floats as ``float_dtype``.

    int64 because that is what class indices must be (torch's ``cross_entropy`` wants
    ``Long`` targets; Keras' sparse losses and ``tf.one_hot`` take int64); the integer
    stays an integer, as it was written. ``float_dtype`` None keeps a float's width.
    """
    if np.issubdtype(dtype, np.integer):
        return np.dtype(np.int64)
    if np.issubdtype(dtype, np.floating) and float_dtype is not None:
        return float_dtype
    return dtype


class BatchStream:
    """Cast numpy batches of one shard, epoch after epoch.

    Iterating again continues with the next epochs (new shuffles), as petastorm's loader
    resets its reader; ``close()`` stops the reading threads and ends every iteration.

    Args:
        reader: The shard's reader (rows, batch size, shuffle and seed are its own).
        num_epochs: Epochs per iteration; None: iterate forever.
        float_dtype: dtype of floating-point columns; None keeps them as written.
    """

    def __init__(self, reader: ShardReader, num_epochs: int | None,
                 float_dtype: np.dtype | None) -> None:
        if num_epochs is not None and (
                not isinstance(num_epochs, (int, np.integer)) or isinstance(num_epochs, bool)
                or num_epochs < 1):
            raise ConfigError(f"num_epochs must be None (forever) or an int >= 1, "
                              f"got {num_epochs!r}")
        self.reader = reader
        self.num_epochs = None if num_epochs is None else int(num_epochs)
        self.dtypes = {name: target_dtype(dtype, float_dtype)
                       for name, (_, dtype) in reader.column_info().items()}
        self._next_epoch = 0
        self._open: set[Prefetcher] = set()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch, the same on every shard."""
        return self.reader.steps_per_epoch

    def __len__(self) -> int:
        if self.num_epochs is None:
            raise TypeError("a loader with num_epochs=None never ends and has no len(); use "
                            "steps_per_epoch to count the batches of one epoch")
        return self.num_epochs * self.steps_per_epoch

    def __iter__(self) -> Iterator[Batch]:
        done = 0
        while not self._closed and (self.num_epochs is None or done < self.num_epochs):
            with self._lock:
                epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
                if self._closed:
                    return
                batches = self.reader.epoch(epoch)
                self._open.add(batches)
            try:
                for batch in batches:
                    yield {name: np.asarray(arr).astype(self.dtypes[name], copy=False)
                           for name, arr in batch.items()}
            finally:
                batches.close()
                with self._lock:
                    self._open.discard(batches)
            done += 1

    def close(self) -> None:
        """Stop the reading threads; iterations still running end at their next batch."""
        with self._lock:
            self._closed = True
            opened, self._open = list(self._open), set()
        for batches in opened:
            batches.close()
