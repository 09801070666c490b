"""The Horovod-era Keras example, with only the import changed.

Run on 2 local ranks:   hvdrun -np 2 python examples/keras_seed.py
Or on Spark:            hvd_spark.run(keras_seed.train, num_proc=2)
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def train(epochs: int = 1, verbose: int = 0) -> dict:
    """Train a small classifier on synthetic data; returns this rank's summary."""
    import numpy as np
    import tensorflow as tf

    import hvd_spark.tensorflow as hvd

    hvd.init()

    # TF2's way of pinning one GPU per process (a no-op on CPU-only machines).
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    # Each rank reads its own shard of the data.
    rng = np.random.default_rng(hvd.rank())
    x_train = rng.normal(size=(8000, 20)).astype("float32")
    y_train = tf.keras.utils.to_categorical((x_train[:, :5].sum(axis=1) > 0).astype(int), 2)

    model = tf.keras.models.Sequential([
        tf.keras.Input(shape=(20,)),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(2, activation="softmax"),
    ])
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=optimizer, loss="categorical_crossentropy")
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    history = model.fit(x_train, y_train, callbacks=callbacks, epochs=epochs,
                        steps_per_epoch=500 // hvd.size(), verbose=verbose)
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    return {"rank": hvd.rank(), "size": hvd.size(), "loss": history.history["loss"],
            "weights_sum": float(weights.astype(np.float64).sum())}


if __name__ == "__main__":
    summary = train(verbose=2 if os.environ.get("HVD_SPARK_RANK", "0") == "0" else 0)
    print(f"rank {summary['rank']}/{summary['size']}: loss {summary['loss'][-1]:.4f} "
          f"weights checksum {summary['weights_sum']:.6f}")
