"""Data for TensorFlow: a ``tf.data.Dataset`` of batches, and ``Converter``'s dataset.

``as_tf_dataset`` reads one epoch of a ``hvd_spark.data.ShardReader`` as a dataset;
``TFDatasetContext`` is what ``Converter.make_tf_dataset`` returns.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hvd_spark.data.converter_loaders import BatchStream
from hvd_spark.data.reader import ShardReader


def as_tf_dataset(reader: ShardReader, epoch: int = 0) -> Any:
    """Return a ``tf.data.Dataset`` over the batches of ``reader.epoch(epoch)``.

    Each element is a dict column -> tensor of shape ``(batch_size, *shape)``; the
    dataset holds exactly ``reader.steps_per_epoch`` elements.
    """
    signature = {
        name: tf.TensorSpec((reader.batch_size, *shape), tf.as_dtype(dtype))
        for name, (shape, dtype) in reader.column_info().items()
    }
    dataset = tf.data.Dataset.from_generator(lambda: reader.epoch(epoch),
                                             output_signature=signature)
    return dataset.apply(tf.data.experimental.assert_cardinality(reader.steps_per_epoch))


class TFDatasetContext:
    """Context manager of a ``tf.data.Dataset`` of dicts ``column -> tf.Tensor``.

    The dataset's elements have a static shape ``(batch_size, *shape)`` and a known
    cardinality (``steps_per_epoch x num_epochs``, or infinite for ``num_epochs=None``),
    so Keras' ``fit`` needs ``steps_per_epoch`` only for an infinite one.
    """

    def __init__(self, stream: BatchStream) -> None:
        self._stream = stream
        reader = stream.reader
        signature = {
            name: tf.TensorSpec((reader.batch_size, *shape), tf.as_dtype(stream.dtypes[name]))
            for name, (shape, _) in reader.column_info().items()
        }
        dataset = tf.data.Dataset.from_generator(lambda: iter(stream),
                                                 output_signature=signature)
        steps = (tf.data.INFINITE_CARDINALITY if stream.num_epochs is None
                 else len(stream))
        self.dataset = dataset.apply(tf.data.experimental.assert_cardinality(steps))

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch, the same on every rank."""
        return self._stream.steps_per_epoch

    def __enter__(self) -> Any:
        return self.dataset

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the reading threads; the dataset yields nothing more."""
        self._stream.close()
