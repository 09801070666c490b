"""Bad input to the Keras binding fails fast with a clear error on every rank."""

from __future__ import annotations

import os

import tensorflow  # noqa: F401 - CI installs it: never a skip

from hvd_spark.runner.local.local_launcher import run_local  # noqa: E402

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "HVD_SPARK_TIMEOUT": "60"}


def _bad_input_worker() -> dict:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import keras
    import numpy as np
    import tensorflow as tf

    import hvd_spark.tensorflow as hvd
    from hvd_spark.errors import ConfigError, HvdSparkError

    hvd.init()
    r = hvd.rank()
    out: dict = {}
    try:
        hvd.DistributedOptimizer(object())
    except ConfigError as exc:
        out["obj"] = str(exc)
    try:  # TF1 optimizers are wrapped, but reduce at every step
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                 backward_passes_per_step=2)
    except ConfigError as exc:
        out["v1"] = str(exc)
    try:
        hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0)
    except ConfigError as exc:
        out["bpps"] = str(exc)

    # Rank 1 builds a wider layer: the fused gradient buffers disagree in size.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4 + r), keras.layers.Dense(1)])
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    try:
        model.fit(x, y, batch_size=4, verbose=0)
        out["fit"] = "no error"
    except ConfigError as exc:  # checked once, when the train step is first traced
        out["fit"] = str(exc)
    try:
        hvd.broadcast_variables(model.variables, root_rank=0)
        out["bcast"] = "no error"
    except HvdSparkError as exc:
        out["bcast"] = str(exc)
    return out


def test_bad_input_errors_without_hanging():
    for res in run_local(_bad_input_worker, num_proc=2, env=ENV):
        assert "backward_passes_per_step > 1 needs a Keras" in res["v1"]
        assert "expects a Keras 3 optimizer" in res["obj"] and "object" in res["obj"]
        assert "backward_passes_per_step" in res["bpps"]
        assert "DistributedOptimizer: ranks [1] disagree" in res["fit"]
        assert "tensor #0: rank 0 has ((3, 4), 'float32'), rank 1 has ((3, 5)" in res["fit"]
        assert "broadcast_variables" in res["bcast"] and "disagree" in res["bcast"]
