"""The README's main job: a TorchEstimator fitted on a real data set on local Spark.

scikit-learn's handwritten digits (1,797 8x8 images, shipped with the package) become
a Spark DataFrame; ``TorchEstimator(num_proc=2)`` writes it as Parquet shards, trains
a small conv net on 2 barrier-mode ranks with hvd_spark's DistributedOptimizer
(per-epoch metrics stream to this console while it trains), and the fitted model's
``transform`` predicts the held-out quarter of the images.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time


def build_model():
    """A small conv net for 8x8 digit images."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def main() -> int:
    """Fit, predict, report; exit non-zero if the model did not learn."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    import numpy as np
    import torch
    from pyspark.sql import SparkSession
    from sklearn.datasets import load_digits

    from hvd_spark.estimator import TorchEstimator

    spark = (SparkSession.builder.master("local[2]").appName("hvd_spark-demo")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    digits = load_digits()
    images = (digits.data / 16.0).astype(float)
    rng = np.random.default_rng(0)
    is_test = rng.random(len(images)) < 0.25
    rows = [(img.tolist(), int(label), bool(test))
            for img, label, test in zip(images, digits.target, is_test)]
    df = spark.createDataFrame(rows, "pixels array<double>, digit long, is_test boolean")
    train, test = df.filter("not is_test"), df.filter("is_test")
    print(f"digits: {train.count()} training and {test.count()} held-out images, 10 classes")

    model = build_model()
    estimator = TorchEstimator(
        num_proc=2, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.003),
        loss=torch.nn.CrossEntropyLoss(), feature_cols=["pixels"], label_cols=["digit"],
        input_shapes=[[-1, 1, 8, 8]], batch_size=32, epochs=8, validation=0.1,
        store=tempfile.mkdtemp(prefix="hvd_spark_demo_"), verbose=1)
    start = time.time()
    fitted = estimator.fit(train)
    print(f"fit on 2 ranks took {time.time() - start:.1f} s")

    predictions = fitted.transform(test).select("digit", "digit__output").collect()
    accuracy = float(np.mean([int(np.argmax(r["digit__output"])) == r["digit"]
                              for r in predictions]))
    last = fitted.getHistory()[-1]  # Horovod's torch history: train/validation per epoch
    print(f"final epoch: loss {last['train']['loss']:.4f}, "
          f"val_loss {last['validation']['loss']:.4f}")
    print(f"held-out accuracy from transform(): {accuracy:.3f} on {len(predictions)} images")
    spark.stop()
    return 0 if accuracy > 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
