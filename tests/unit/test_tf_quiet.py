"""A Keras model's predictor (what ``transform`` runs in every Python worker) imports
TensorFlow without its native start-up lines on stderr."""

from __future__ import annotations

import os
import subprocess
import sys

_SCRIPT = """
import sys
import numpy as np
from hvd_spark.estimator.keras_worker import keras_predictor
with open(sys.argv[1], "rb") as f:
    predict = keras_predictor(f.read())
print(predict([np.ones((3, 4), np.float32)])[0].shape)
"""


def test_the_predictor_imports_tensorflow_quietly(tmp_path):
    import pickle

    import keras

    from hvd_spark.estimator.keras_worker import model_to_bytes

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    path = tmp_path / "model.bin"
    path.write_bytes(pickle.dumps({"model": model_to_bytes(model)}))
    # As a Spark Python worker starts: nothing set up, TF_CPP_MIN_LOG_LEVEL not set.
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "(3, 2)"
    # TensorFlow 2.21 prints "WARNING: All log messages before absl::InitializeLog() ..."
    # and "I0000 ... oneDNN custom operations are on ..." here without the quiet import.
    assert done.stderr == "", done.stderr[-3000:]
