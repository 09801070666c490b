"""Numpy batches -> torch tensors or a ``tf.data.Dataset``.

The frameworks are imported with ``importlib`` inside the functions: importing this
module (or ``hvd_spark.data``) never loads torch or TensorFlow, and the layer
contracts in pyproject.toml (which see every ``import`` statement) stay true.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from hvd_spark.data.reader import ShardReader


def as_torch(batches: Iterable[dict[str, np.ndarray]], device: Any = None) -> Iterator[dict]:
    """Yield each batch as a dict of ``torch.Tensor`` (zero-copy on CPU where possible).

    Args:
        batches: Batches from ``ShardReader.epoch``.
        device: Optional torch device to move the tensors to (e.g. ``"cuda"``).
    """
    torch = importlib.import_module("torch")
    for batch in batches:
        out = {}
        for name, arr in batch.items():
            # Read-only arrays (zero-copy views of Arrow buffers) cannot back a tensor.
            tensor = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
            out[name] = tensor.to(device, non_blocking=True) if device is not None else tensor
        yield out


def as_tf_dataset(reader: ShardReader, epoch: int = 0) -> Any:
    """Return a ``tf.data.Dataset`` over the batches of ``reader.epoch(epoch)``.

    Each element is a dict column -> tensor of shape ``(batch_size, *shape)``; the
    dataset holds exactly ``reader.steps_per_epoch`` elements.
    """
    tf = importlib.import_module("tensorflow")
    signature = {
        name: tf.TensorSpec((reader.batch_size, *shape), tf.as_dtype(dtype))
        for name, (shape, dtype) in reader.column_info().items()
    }
    dataset = tf.data.Dataset.from_generator(lambda: reader.epoch(epoch),
                                             output_signature=signature)
    return dataset.apply(tf.data.experimental.assert_cardinality(reader.steps_per_epoch))
