"""The smallest patch that lets Keras 3.15 ``model.fit`` run under MultiWorkerMirroredStrategy.

Out of the box it fails twice (keras-team/keras#20585, tensorflow/tensorflow#72388):

1. ``TensorFlowTrainer._maybe_symbolic_build`` reduces the first distributed batch
   with ``strategy.reduce("MEAN", batch, axis=None)``, which MWMS cannot do on a
   tuple of PerReplica values ("Attempt to convert a value (PerReplica...)").
   The symbolic build only needs shapes: we hand it the first local replica's batch.
2. ``reduce_per_replica`` averages the per-step logs with
   ``strategy.reduce("MEAN", v, axis=0)``, which fails on scalar losses ("Invalid
   reduction dimension 0 for input with 0 dimensions"): we reduce with ``axis=None``.
"""

from __future__ import annotations

DESCRIPTION = (
    "patched Keras for MWMS: TensorFlowTrainer._maybe_symbolic_build builds from the first "
    "local replica's batch (keras#20585) and reduce_per_replica averages scalar logs with "
    "axis=None (tensorflow#72388)"
)


def apply() -> None:
    """Monkeypatch Keras's TensorFlow trainer in this process (idempotent)."""
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer

    if getattr(trainer, "_hvd_spark_mwms_patch", False):
        return
    build = trainer.TensorFlowTrainer._maybe_symbolic_build
    reduce_per_replica = trainer.reduce_per_replica

    def maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is not None and strategy is not None:
            for _, _, it in iterator:
                batch = next(it)
                data_batch = tf.nest.map_structure(
                    lambda v: strategy.experimental_local_results(v)[0], batch)
                break
            iterator = None
        return build(self, iterator=iterator, data_batch=data_batch)

    def reduce_logs(values, strategy, reduction="auto"):
        if reduction in ("auto", "mean") and trainer._collective_all_reduce_multi_worker(strategy):
            return tf.nest.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return reduce_per_replica(values, strategy, reduction)

    trainer.TensorFlowTrainer._maybe_symbolic_build = maybe_symbolic_build
    trainer.reduce_per_replica = reduce_logs
    trainer._hvd_spark_mwms_patch = True
