"""What the driver hands every rank for training, and the readers built from it.

Worker side: nothing here imports pyspark, so the training functions run in any
process that has the framework (a Spark task's child, ``hvdrun``, a GPU box).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hvd_spark.data.spec import DatasetSpec
from hvd_spark.data.store import Store


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """Everything a worker needs to train, besides the serialized model.

    Attributes:
        dataset: Where the Parquet shards are and what they hold.
        store: The Store holding data and checkpoints.
        run_id: Checkpoints go to ``<store>/runs/<run_id>/checkpoints``.
        batch_size, val_batch_size: Rows per batch on each rank.
        epochs: Total epochs; training resumes at ``start_epoch``.
        start_epoch: First epoch to run (after the last checkpoint, when resuming).
        shuffle, seed: Shuffling of the rows, different each epoch.
        train_steps, val_steps: Batches per epoch (None: all rows).
        backward_passes_per_step: Batches accumulated before each allreduce.
        compression: The bindings' Compression choice (None: none).
        verbose: 1 prints a line per epoch on rank 0 (forwarded live to the driver).
        use_gpu: Train on the rank's GPU.
        extra: Framework-specific settings.
    """

    dataset: DatasetSpec
    store: Store
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
    extra: dict = dataclasses.field(default_factory=dict)


def make_readers(spec: TrainSpec, rank: int, size: int) -> tuple[Any, Any]:
    """This rank's training reader and validation reader (None without validation data)."""
    from hvd_spark.data.reader import ShardReader

    ds = spec.dataset
    cols = [*ds.feature_cols, *ds.label_cols]
    if ds.sample_weight_col:
        cols.append(ds.sample_weight_col)
    train = ShardReader(ds, rank, size, spec.batch_size, split="train", columns=cols,
                        shuffle=spec.shuffle, seed=spec.seed, steps_per_epoch=spec.train_steps)
    val = None
    if ds.val.num_rows:
        val = ShardReader(ds, rank, size, spec.val_batch_size, split="val", columns=cols,
                          shuffle=False, steps_per_epoch=spec.val_steps)
    return train, val
