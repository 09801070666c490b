"""The Estimators' dry run on real local Spark: a mistake of columns against model fails
with a clear message before any data is written, a good model passes untouched, and
``dry_run=False`` skips it."""

from __future__ import annotations

import time

import numpy as np
import pytest
from pyspark.ml.feature import VectorAssembler
from pyspark.sql import functions as F

from hvd_spark.errors import ConfigError
from hvd_spark.estimator import KerasEstimator, TorchEstimator, dry_run


@pytest.fixture(scope="module")
def frame(spark):
    rng = np.random.default_rng(0)
    rows = [(*map(float, x), int(x[0] > 0)) for x in rng.normal(size=(200, 4))]
    df = spark.createDataFrame(rows, "a double, b double, c double, d double, label long")
    df = VectorAssembler(inputCols=["a", "b", "c", "d"], outputCol="features").transform(df)
    df = df.withColumn("label_d", F.col("label").cast("double"))
    df.take(1)  # the session's first job (JVM warm-up) is not the dry run's cost
    return df


def _torch(tmp_path, model=None, **overrides):
    import torch

    model = model or torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                         torch.nn.Linear(8, 2))
    kwargs = dict(num_proc=2, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"],
                  label_cols=["label"], batch_size=8, store=str(tmp_path / "store"), verbose=0)
    kwargs.update(overrides)
    return TorchEstimator(**kwargs)


def _nothing_written(tmp_path) -> bool:
    store = tmp_path / "store"
    return not any(p.is_file() for p in store.rglob("*")) if store.exists() else True


@pytest.mark.smoke
def test_a_float_label_for_cross_entropy_fails_before_any_data_is_written(frame, tmp_path):
    started = time.monotonic()
    with pytest.raises(ConfigError) as got:
        _torch(tmp_path, label_cols=["label_d"]).fit(frame)
    took = time.monotonic() - started
    message = str(got.value)
    assert message.startswith("label column 'label_d' is double; CrossEntropyLoss wants "
                              "integer class indices: cast the column (df.withColumn("
                              "'label_d', F.col('label_d').cast('long'))), or pass "
                              "loss=lambda out, y: F.cross_entropy(out, y.long())"), message
    assert _nothing_written(tmp_path), "no Parquet, no run directory: the ranks never started"
    # A fit gets here in well under a second on an idle machine (the bound allows for a
    # loaded CI box); writing the data and starting the ranks alone take longer.
    assert took < 10, f"{took:.1f} s: the dry run must fail long before training would"


def test_a_model_narrower_than_the_feature_column_names_both(frame, tmp_path):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with pytest.raises(ConfigError, match=r"^feature column 'features' holds 4 values per row "
                                          r"but the model's first layer Linear\(in_features=5, "
                                          r"out_features=8, bias=True\) expects 5; the column "
                                          r"is vector.*in_features=4"):
        _torch(tmp_path, model=model).fit(frame)
    assert _nothing_written(tmp_path)


def test_a_good_model_passes_and_stays_as_it_was(frame, tmp_path):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    est = _torch(tmp_path, model=model, metrics=[lambda out, y: (out.argmax(1) == y).float()
                                                 .mean()])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = est.getOptimizer().state_dict()
    dry_run.check(est, frame)  # a fit's first step after its parameter checks
    assert model.training, "the user's model stays in training mode"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert est.getOptimizer().state_dict() == optimizer
    assert est.getDryRun() is True  # the default: every fit of test_estimators runs it


def test_dry_run_false_skips_it(frame, tmp_path, monkeypatch):
    from hvd_spark.data import writer

    class Reached(Exception):
        pass

    def write_dataset(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(writer, "write_dataset", write_dataset)
    with pytest.raises(Reached):  # past where the dry run would have refused the label
        _torch(tmp_path, label_cols=["label_d"], dry_run=False).fit(frame)
    with pytest.raises(ConfigError, match="dry_run must be True or False"):
        _torch(tmp_path, dry_run="yes").fit(frame)


def test_keras_index_labels_for_categorical_crossentropy_fail_early(frame, tmp_path):
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    weights = [w.copy() for w in model.get_weights()]
    est = KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.Adam(),
                         loss="categorical_crossentropy", feature_cols=["features"],
                         label_cols=["label"], batch_size=8, store=str(tmp_path / "store"),
                         verbose=0)
    with pytest.raises(ConfigError, match=r"^label column 'label' \(bigint\) holds one class "
                                          r"index per row, but categorical_crossentropy wants "
                                          r"one-hot rows of 2: pass "
                                          r"loss='sparse_categorical_crossentropy'"):
        est.fit(frame)
    assert _nothing_written(tmp_path)
    est.setLoss("sparse_categorical_crossentropy")
    dry_run.check(est, frame)  # the fixed loss passes
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))
