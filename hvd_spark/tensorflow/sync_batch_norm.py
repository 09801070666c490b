"""``SyncBatchNormalization``: batch statistics over every rank's batch, not just this one's.

A Keras 3 ``BatchNormalization`` whose training-time moments come from all ranks: the
sums and counts are allreduced (two small fused collectives: mean first, then the
squared deviations from it, which is numerically safer than E[x^2] - E[x]^2). Gradients
flow through the allreduces, so each rank's inputs get the gradient of the global
statistics. Ranks may have batches of different sizes.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hvd_spark import collectives as C
from hvd_spark.collectives.elastic import is_elastic
from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.tensorflow.ops import grouped_allreduce


@keras.saving.register_keras_serializable(package="hvd_spark")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization with statistics synchronised across ranks (Horovod's name).

    Takes the arguments of ``keras.layers.BatchNormalization`` (except
    ``synchronized``, which means ``tf.distribute`` synchronisation there).
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.pop("fused", None)  # TF2 Keras argument, meaningless in Keras 3
        kwargs.pop("synchronized", None)
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> tuple[tf.Tensor, tf.Tensor]:
        # Decided when traced; an elastic ring of one may grow, so it keeps the collective.
        if not C.is_initialized() or (C.size() == 1 and not is_elastic()):
            return super()._moments(inputs, mask)
        x = tf.convert_to_tensor(inputs)
        compute = tf.float32 if x.dtype in (tf.float16, tf.bfloat16) else x.dtype
        x = tf.cast(x, compute)
        axes = list(self._reduction_axes)
        if mask is None:
            weights = tf.ones_like(x)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), compute)
        local_sum = tf.reduce_sum(x * weights, axes, keepdims=True)
        local_count = tf.reduce_sum(weights, axes, keepdims=True)
        total, count = grouped_allreduce([local_sum, local_count], op=ReduceOp.Sum)
        count = tf.maximum(count, 1.0)
        mean = total / count  # keeps the reduced axes, so it broadcasts against x
        squares = tf.reduce_sum(tf.square((x - mean) * weights), axes, keepdims=True)
        variance = grouped_allreduce([squares], op=ReduceOp.Sum)[0] / count
        channels = [d for d in range(x.shape.rank) if d not in axes]
        shape = tf.gather(tf.shape(x), channels)
        return tf.reshape(mean, shape), tf.reshape(variance, shape)
