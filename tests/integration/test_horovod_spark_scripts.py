"""Horovod-on-Spark scripts, written against Horovod's API, run with only the imports changed.

Each test is shaped like Horovod's own ``keras_spark_mnist.py`` / ``pytorch_spark_mnist.py``
examples: a libsvm file of flat 784-pixel images (SparseVector features), one-hot
SparseVector labels from ``OneHotEncoder`` (Keras), a ``SparkBackend``, ``Store.create``,
``input_shapes`` with Horovod's -1 batch dimension (torch), ``inmemory_cache_all`` and a
TensorBoard callback (Keras), ``setOutputCols`` and a Spark evaluator. The images are
synthetic (10 classes, each lights its own band of rows, plus noise): tiny and learnable
in a few epochs, so the expected accuracy is near 1.
"""

from __future__ import annotations

import sys

import numpy as np
import pyspark  # noqa: F401 - CI installs it: never a skip


def _write_libsvm(path, n: int, seed: int) -> None:
    """Sparse 28x28 images: class c has bright pixels in rows 2c+3 and 2c+4, plus noise."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        label = int(rng.integers(10))
        image = np.zeros((28, 28))
        image[2 * label + 3: 2 * label + 5, 4:24] = rng.uniform(0.5, 1.0, size=(2, 20))
        noise = rng.integers(0, 784, size=20)
        image.reshape(-1)[noise] = rng.uniform(0.0, 0.5, size=20)
        flat = image.reshape(-1)
        cells = " ".join(f"{i + 1}:{v:.3f}" for i in np.flatnonzero(flat) for v in [flat[i]])
        lines.append(f"{label} {cells}")
    path.write_text("\n".join(lines) + "\n")


def _mnist_like(spark, tmp_path):
    _write_libsvm(tmp_path / "train.libsvm", 900, 0)
    _write_libsvm(tmp_path / "test.libsvm", 200, 1)
    read = spark.read.format("libsvm").option("numFeatures", "784")
    return (read.load(str(tmp_path / "train.libsvm")), read.load(str(tmp_path / "test.libsvm")))


def test_horovod_pytorch_spark_mnist_script(spark, tmp_path):
    # --- the only lines that differ from the Horovod script: its imports ---------------
    # Horovod: import horovod.spark.torch as hvd
    import hvd_spark.estimator as hvd  # noqa: I001 - kept in the script's order

    # Horovod: from horovod.spark.common.backend import SparkBackend
    from hvd_spark import SparkBackend

    # Horovod: from horovod.spark.common.store import Store
    from hvd_spark.data import Store

    # --- the Horovod script -------------------------------------------------------------
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.sql.functions import udf
    from pyspark.sql.types import DoubleType

    train_df, test_df = _mnist_like(spark, tmp_path)
    store = Store.create(str(tmp_path / "work"))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 4, kernel_size=5)
            self.fc = nn.Linear(4 * 6 * 6, 10)

        def forward(self, x):
            x = F.relu(F.max_pool2d(self.conv(x.float()), 4))
            return F.log_softmax(self.fc(x.view(-1, 4 * 6 * 6)), dim=-1)

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    loss = nn.NLLLoss()
    backend = SparkBackend(num_proc=2, stdout=sys.stdout, stderr=sys.stderr,
                           prefix_output_with_timestamp=True)
    torch_estimator = hvd.TorchEstimator(
        backend=backend, store=store, model=model, optimizer=optimizer,
        loss=lambda input, target: loss(input, target.long()),
        input_shapes=[[-1, 1, 28, 28]], feature_cols=["features"], label_cols=["label"],
        batch_size=32, epochs=4, validation=0.1, verbose=1)
    torch_model = torch_estimator.fit(train_df).setOutputCols(["label_prob"])

    argmax = udf(lambda v: float(np.argmax(v)), returnType=DoubleType())
    pred_df = torch_model.transform(test_df)
    pred_df = pred_df.withColumn("label_pred", argmax(pred_df.label_prob))
    evaluator = MulticlassClassificationEvaluator(predictionCol="label_pred", labelCol="label",
                                                  metricName="accuracy")
    accuracy = evaluator.evaluate(pred_df)
    # --- end of the script --------------------------------------------------------------

    assert accuracy > 0.9, accuracy
    history = torch_model.getHistory()
    assert len(history) == 4 and history[-1]["train"]["loss"] < history[0]["train"]["loss"]
    assert "validation" in history[-1]
    assert torch_model.getInputShapes() == [(-1, 1, 28, 28)]
    assert torch_model.getFeatureColumns() == ["features"]
    assert torch_model.getLabelColumns() == ["label"]
    trained = torch_model.getOptimizer()
    assert isinstance(trained, torch.optim.SGD)
    assert trained.param_groups[0]["momentum"] == 0.5
    assert trained.param_groups[0]["params"][0] is next(torch_model.getModel().parameters())


def test_horovod_keras_spark_mnist_script(spark, tmp_path):
    # --- the only lines that differ from the Horovod script: its imports ---------------
    # Horovod: import horovod.spark.keras as hvd
    import hvd_spark.estimator as hvd  # noqa: I001 - kept in the script's order

    # Horovod: from horovod.spark.common.store import Store
    from hvd_spark.data import Store

    # --- the Horovod script -------------------------------------------------------------
    import keras
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.feature import OneHotEncoder
    from pyspark.sql.functions import udf
    from pyspark.sql.types import DoubleType

    train_df, test_df = _mnist_like(spark, tmp_path)
    store = Store.create(str(tmp_path / "work"))
    encoder = OneHotEncoder(inputCols=["label"], outputCols=["label_vec"], dropLast=False)
    encoder_model = encoder.fit(train_df)
    train_df = encoder_model.transform(train_df)
    test_df = encoder_model.transform(test_df)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(4, kernel_size=(5, 5), activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(4, 4)),
        keras.layers.Flatten(),
        keras.layers.Dense(10, activation="softmax"),
    ])
    optimizer = keras.optimizers.Adam(0.01)
    loss = keras.losses.categorical_crossentropy
    keras_estimator = hvd.KerasEstimator(
        num_proc=2, store=store, model=model, optimizer=optimizer, loss=loss,
        metrics=["accuracy"], feature_cols=["features"], label_cols=["label_vec"],
        batch_size=32, epochs=4, validation=0.1, inmemory_cache_all=True, verbose=1,
        callbacks=[keras.callbacks.TensorBoard(log_dir=str(tmp_path / "tb"))])
    keras_model = keras_estimator.fit(train_df).setOutputCols(["label_prob"])

    argmax = udf(lambda v: float(np.argmax(v)), returnType=DoubleType())
    pred_df = keras_model.transform(test_df)
    pred_df = pred_df.withColumn("label_pred", argmax(pred_df.label_prob))
    evaluator = MulticlassClassificationEvaluator(predictionCol="label_pred", labelCol="label",
                                                  metricName="accuracy")
    accuracy = evaluator.evaluate(pred_df)
    # --- end of the script --------------------------------------------------------------

    assert accuracy > 0.9, accuracy
    history = keras_model.getHistory()
    assert len(history["loss"]) == 4 and len(history["val_loss"]) == 4
    assert history["val_accuracy"][-1] > 0.9
    # The TensorBoard callback wrote to the run's logs path in the store (as in Horovod).
    logs = store.logs_path(keras_model.getRunId())
    for split in ("train", "validation"):
        events = [f for f in store.list_files(f"{logs}/{split}") if "tfevents" in f]
        assert events and not (tmp_path / "tb").exists(), (split, store.list_files(logs))
    assert keras_model.getCustomObjects() is None or keras_model.getCustomObjects() == {}
    assert isinstance(keras_model.getOptimizer(), keras.optimizers.Adam)


def test_horovod_pytorch_lightning_spark_mnist_script(spark, tmp_path):
    # --- the only lines that differ from the Horovod script: its imports ---------------
    # Horovod: import horovod.spark.lightning as hvd
    import hvd_spark.estimator.lightning as hvd  # noqa: I001 - kept in the script's order

    # Horovod: from horovod.spark.common.backend import SparkBackend
    from hvd_spark import SparkBackend

    # Horovod: from horovod.spark.common.store import Store
    from hvd_spark.data import Store

    # --- the Horovod script (validation_epoch_end dropped: Lightning 2 removed it) -------
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torch.optim as optim
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.sql.functions import udf
    from pyspark.sql.types import DoubleType
    from pytorch_lightning import Callback, LightningModule
    from pytorch_lightning.callbacks import ModelCheckpoint

    train_df, test_df = _mnist_like(spark, tmp_path)
    store = Store.create(str(tmp_path / "work"))

    class Net(LightningModule):
        def __init__(self, kernel_size):
            super().__init__()
            self.save_hyperparameters()
            self.conv = nn.Conv2d(1, 4, kernel_size=kernel_size)
            self.fc = nn.Linear(4 * 6 * 6, 10)

        def forward(self, x):
            x = x.float().reshape((-1, 1, 28, 28))
            x = F.relu(F.max_pool2d(self.conv(x), 4))
            return F.log_softmax(self.fc(x.view(-1, 4 * 6 * 6)), -1)

        def configure_optimizers(self):
            return optim.SGD(self.parameters(), lr=0.1, momentum=0.5)

        def training_step(self, batch, batch_idx):
            x, y = batch["features"], batch["label"]
            loss = F.nll_loss(self(x), y.long())
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch["features"], batch["label"]
            self.log("val_loss", F.nll_loss(self(x), y.long()))

    class CountEpochs(Callback):
        def __init__(self):
            self.train_epoch_ends = 0

        def on_train_epoch_end(self, trainer, model):
            self.train_epoch_ends += 1

    torch.manual_seed(0)
    model = Net(5)
    backend = SparkBackend(num_proc=2, stdout=sys.stdout, stderr=sys.stderr,
                           prefix_output_with_timestamp=True)
    callbacks = [CountEpochs(), ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=1)]
    torch_estimator = hvd.TorchEstimator(
        backend=backend, store=store, model=model, input_shapes=[[-1, 1, 28, 28]],
        feature_cols=["features"], label_cols=["label"], batch_size=32, epochs=4,
        validation=0.1, verbose=1, callbacks=callbacks)
    torch_model = torch_estimator.fit(train_df).setOutputCols(["label_prob"])

    pred_df = torch_model.transform(test_df)
    argmax = udf(lambda v: float(np.argmax(v)), returnType=DoubleType())
    pred_df = pred_df.withColumn("label_pred", argmax(pred_df.label_prob))
    evaluator = MulticlassClassificationEvaluator(predictionCol="label_pred", labelCol="label",
                                                  metricName="accuracy")
    accuracy = evaluator.evaluate(pred_df)
    # --- end of the script --------------------------------------------------------------

    assert accuracy > 0.9, accuracy
    assert set(torch_model.getHistory()) >= {"train_loss", "val_loss"}  # logged_metrics
    epochs = torch_model.getEpochHistory()
    assert [e["epoch"] for e in epochs] == [1, 2, 3, 4]
    assert epochs[-1]["val_loss"] < epochs[0]["val_loss"]
    assert isinstance(torch_model.getModel(), Net) and torch_model.getOptimizer() is None
    assert store.list_checkpoints(torch_model.getRunId()) == [0, 1, 2, 3]


def test_horovod_run_keywords_are_accepted(spark):
    import os

    import hvd_spark

    def rank_env():
        import hvd_spark.collectives as hvd

        hvd.init()
        return hvd.rank(), os.environ.get("HVD_SPARK_IFACE")

    # Horovod: horovod.spark.run(fn, num_proc=2, use_gloo=True, nics=..., ...)
    results = hvd_spark.run(rank_env, num_proc=2, use_gloo=True, use_mpi=False, nics={"lo"},
                            extra_mpi_args="-x NCCL_DEBUG=INFO", executable=sys.executable,
                            verbose=0)
    assert results == [(0, "lo"), (1, "lo")]
