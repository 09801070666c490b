"""What the driver hands every rank for training, and the one batch source all Estimators read.

Worker side: nothing here imports pyspark, so the training functions run in any
process that has the framework (a Spark task's child, ``hvdrun``, a GPU box).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from hvd_spark.data.spec import IS_VAL, DatasetSpec
from hvd_spark.data.store import Store
from hvd_spark.errors import ConfigError, DataError

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """Everything a worker needs to train, besides the serialized model.

    Attributes:
        dataset: What the rows hold; where the Parquet shards are (Store path).
        store: The Store holding data and checkpoints; None on the direct path, where
            each rank reads its share of the DataFrame handed over by its Spark task
            (``data.rank_share``) and nothing is checkpointed.
        run_id: Checkpoints go to ``<store>/runs/<run_id>/checkpoints``.
        batch_size, val_batch_size: Rows per batch on each rank.
        epochs: Total epochs; training resumes at ``start_epoch``.
        start_epoch: First epoch to run (after the last checkpoint, when resuming).
        shuffle, seed: Shuffling of the rows, different each epoch.
        train_steps, val_steps: Batches per epoch (None: all rows).
        backward_passes_per_step: Batches accumulated before each allreduce.
        compression: The bindings' Compression choice (None: none).
        verbose: 1 prints a line per epoch on rank 0 (forwarded live to the driver).
        use_gpu: Train on the rank's GPU when it has one.
        framework_seed: Seed of the framework's generators (None: not seeded).
        transformation_fn: Applied to every batch (a dict of numpy arrays) before use.
        inmemory_cache_all: Keep the rank's decoded rows in memory after the first epoch.
        shuffle_buffer_size: Rows in the reader's shuffle buffer (None: its default).
        train_reader_threads, val_reader_threads: Decode threads (None: reader default).
        label_shapes: Per-row shape of each label column (None: as stored).
        mp_start_method: multiprocessing start method to set first (None: leave it).
        extra: Framework-specific settings.
        start_step: Steps of ``start_epoch`` already trained (resuming from a step
            checkpoint; 0: the epoch starts afresh).
        checkpoint_every_steps: Also checkpoint every that many steps (None: per epoch).
    """

    dataset: DatasetSpec
    store: Store | None
    run_id: str
    batch_size: int
    val_batch_size: int
    epochs: int
    start_epoch: int
    shuffle: bool
    seed: int
    train_steps: int | None
    val_steps: int | None
    backward_passes_per_step: int
    compression: Any
    verbose: int
    use_gpu: bool
    framework_seed: int | None = None
    transformation_fn: Callable[[Batch], Batch] | None = None
    inmemory_cache_all: bool = False
    shuffle_buffer_size: int | None = None
    train_reader_threads: int | None = None
    val_reader_threads: int | None = None
    label_shapes: Sequence[Sequence[int]] | None = None
    mp_start_method: str | None = None
    extra: dict = dataclasses.field(default_factory=dict)
    start_step: int = 0
    checkpoint_every_steps: int | None = None


class BatchSource:
    """One rank's batches of one split: the sharded reader, optionally cached in memory,
    with ``transformation_fn`` applied to every batch.

    With ``cache``, the rows of the first epoch read are copied into memory and later
    epochs are served from there, reshuffled (seeded by epoch and rank) when
    ``shuffle`` is on: no more Parquet reads, and each rank keeps its first share of
    the rows (as Horovod's ``inmemory_cache_all`` does). The transformation runs after
    the cache, so random augmentations differ every epoch.
    """

    def __init__(self, reader: Any, transform: Callable[[Batch], Batch] | None = None,
                 cache: bool = False, shuffle: bool = False, seed: int = 0) -> None:
        self.reader = reader
        self.transform, self.cache = transform, cache
        self.shuffle, self.seed = shuffle, seed
        self._rows: Batch | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.reader.steps_per_epoch

    @property
    def batch_size(self) -> int:
        return self.reader.batch_size

    def epoch(self, epoch: int) -> Iterator[Batch]:
        """Exactly ``steps_per_epoch`` batches of ``epoch``."""
        for batch in self._raw(epoch):
            yield apply_transformation(self.transform, batch) if self.transform else batch

    def _raw(self, epoch: int) -> Iterator[Batch]:
        if not self.cache:
            yield from self.reader.epoch(epoch)
            return
        if self._rows is None:
            parts: list[Batch] = []
            for batch in self.reader.epoch(epoch):
                parts.append({k: np.array(v) for k, v in batch.items()})  # views -> owned
                yield {k: _read_only(v) for k, v in parts[-1].items()}  # the cache stays intact
            self._rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
            return
        n = len(next(iter(self._rows.values())))
        order = (np.random.default_rng([self.seed, epoch, self.reader.rank, 2]).permutation(n)
                 if self.shuffle else np.arange(n))
        size = self.batch_size
        for step in range(self.steps_per_epoch):
            take = order[step * size:(step + 1) * size]
            yield {k: v[take] for k, v in self._rows.items()}


def apply_transformation(fn: Callable[[Batch], Any], batch: Batch) -> Batch:
    """``fn(batch)`` on writable copies of read-only arrays; the result must be a mapping
    of column -> array with one row per input row."""
    rows = len(next(iter(batch.values())))
    ready = {k: v if v.flags.writeable else np.array(v) for k, v in batch.items()}
    out = fn(ready)
    if out is None:
        out = ready  # a function that changed the dict in place
    if hasattr(out, "to_dict") and hasattr(out, "columns"):  # a pandas DataFrame
        out = {c: _stacked(out[c].to_numpy()) for c in out.columns}
    if not hasattr(out, "items"):
        raise DataError(f"transformation_fn must return a dict of column -> numpy array (or "
                        f"a pandas DataFrame), got {type(out).__name__}")
    result = {k: np.asarray(v) for k, v in out.items()}
    short = sorted(k for k, v in result.items() if v.ndim == 0 or len(v) != rows)
    if short:
        raise DataError(f"transformation_fn returned column(s) {short} without one row per "
                        f"input row ({rows} rows in the batch)")
    return result


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


def _stacked(values: np.ndarray) -> np.ndarray:
    if values.dtype == object and len(values) and isinstance(values[0], np.ndarray):
        return np.stack(values)
    return values


def make_readers(spec: TrainSpec, rank: int, size: int) -> tuple[BatchSource, BatchSource | None]:
    """This rank's training and validation batch sources (None without validation data)."""
    from hvd_spark.data.reader import ShardReader

    ds = spec.dataset
    cols = [*ds.feature_cols, *ds.label_cols]
    if ds.sample_weight_col:
        cols.append(ds.sample_weight_col)
    if spec.store is None:
        return _share_readers(spec, cols)
    train = ShardReader(ds, rank, size, spec.batch_size, split="train", columns=cols,
                        shuffle=spec.shuffle, seed=spec.seed, steps_per_epoch=spec.train_steps,
                        shuffle_buffer_size=spec.shuffle_buffer_size,
                        num_threads=spec.train_reader_threads)
    source = BatchSource(train, spec.transformation_fn, spec.inmemory_cache_all, spec.shuffle,
                         spec.seed)
    val = None
    if ds.val.num_rows:
        reader = ShardReader(ds, rank, size, spec.val_batch_size, split="val", columns=cols,
                             shuffle=False, steps_per_epoch=spec.val_steps,
                             num_threads=spec.val_reader_threads)
        val = BatchSource(reader, spec.transformation_fn, spec.inmemory_cache_all)
    return source, val


def _share_readers(spec: TrainSpec, cols: list[str]) -> tuple[BatchSource, BatchSource | None]:
    """The direct path's sources: this rank's share of the DataFrame, split by the
    inspection's validation marker; the ranks agree on each split's smallest share first
    (one allreduce), so every rank runs the same number of steps."""
    from hvd_spark.collectives import Min, allreduce
    from hvd_spark.data.rank_share import RankShare
    from hvd_spark.data.share_splits import ShareSplitReader, split_rows

    share = RankShare.current()
    train_rows, val_rows = split_rows(share, IS_VAL)
    least = allreduce(np.array([len(train_rows), len(val_rows)], dtype=np.int64),
                      name="hvd_spark.estimator.share_rows", op=Min)
    train = ShareSplitReader(share, train_rows, int(least[0]), spec.batch_size, split="train",
                             columns=cols, shuffle=spec.shuffle, seed=spec.seed,
                             steps_per_epoch=spec.train_steps)
    source = BatchSource(train, spec.transformation_fn, spec.inmemory_cache_all, spec.shuffle,
                         spec.seed)
    val = None
    if spec.dataset.val.num_rows:
        reader = ShareSplitReader(share, val_rows, int(least[1]), spec.val_batch_size,
                                  split="val", columns=cols, shuffle=False, seed=spec.seed,
                                  steps_per_epoch=spec.val_steps)
        val = BatchSource(reader, spec.transformation_fn, spec.inmemory_cache_all)
    return source, val


def batch_shape(shape: Sequence[int], what: str, row_size: int | None = None) -> tuple[int, ...]:
    """A per-row shape, or Horovod's shape with a leading -1 batch dimension, as the
    full batch shape ``(-1, *row_shape)``.

    ``[1, 28, 28]`` and ``[-1, 1, 28, 28]`` both give ``(-1, 1, 28, 28)``. Only the
    leading dimension may be -1; with ``row_size`` the row shape must hold that many
    values. Raises ConfigError naming ``what`` otherwise.
    """
    dims = [int(d) for d in shape]
    row = dims[1:] if dims and dims[0] == -1 else dims
    if any(d < 1 for d in row):
        raise ConfigError(f"{what}={list(shape)}: only a leading batch dimension may be -1 "
                          "and every other dimension must be positive")
    if row_size is not None and math.prod(row) != row_size:
        raise ConfigError(f"{what}={list(shape)} holds {math.prod(row)} values per row, but "
                          f"the column has {row_size}; give the shape of one row (a leading "
                          "-1 for the batch is allowed)")
    return (-1, *row)


def check_loss(value: float, epoch: int, step: int, spec: TrainSpec, steps: int,
               rank: int) -> None:
    """Stop training when the loss is NaN or infinite: every later step would train on it.

    Args:
        value: The training loss of the step.
        epoch, step: 0-based epoch and step within it (named 1-based, as the history is).
        spec: The run's spec (for the number of epochs).
        steps: Steps per epoch.
        rank: The rank that saw the loss.

    Raises:
        DataError: Naming the epoch, the step and what to try.
    """
    if math.isfinite(value):
        return
    raise DataError(
        f"the training loss became {value} at epoch {epoch + 1} of {spec.epochs}, step "
        f"{step + 1} of {steps} (rank {rank}); training stopped instead of returning a broken "
        "model. Lower the learning rate, clip gradients, or look for extreme feature or "
        "label values (write_dataset refuses NaN/inf input, not huge values)")


def set_start_method(method: str | None) -> None:
    """Horovod's ``mp_start_method``: set multiprocessing's start method in this rank."""
    if method:
        import multiprocessing

        multiprocessing.set_start_method(method, force=True)
