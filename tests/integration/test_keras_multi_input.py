"""KerasEstimator end to end on a model with several inputs and two outputs (num_proc=2):
three integer categorical columns, each through its own Embedding, plus a double and a
Vector column; a custom metric, Horovod's BestModelCheckpoint on val_loss, validation by
a 0/1 column; transform, save and load in a fresh Python process.

One module-scoped fit (600 rows, 2 epochs) serves every test: CI has two cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import cloudpickle
import numpy as np
import pytest
from pyspark.ml.linalg import Vectors

from hvd_spark.estimator import KerasEstimator

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on the workers' path

ROWS = 600
CARDINALITIES = (5, 12, 20)
CATEGORICAL = [f"cat{i}" for i in range(len(CARDINALITIES))]
FEATURES = [*CATEGORICAL, "price", "vec"]
LABELS = ["cls", "reg"]
# Fixed per-category effects: the target is learnable only through the embeddings.
EFFECTS = [np.random.default_rng(100 + i).normal(0.0, 1.5, size=c)
           for i, c in enumerate(CARDINALITIES)]
VEC_WEIGHTS = np.array([0.8, -0.6, 0.4])


def _rows(n: int, seed: int) -> list[tuple]:
    """Rows of (id, cat0..cat2, price, vec, cls, reg, is_val); every 5th row validates."""
    rng = np.random.default_rng(seed)
    cats = [rng.integers(0, c, n) for c in CARDINALITIES]
    price = rng.normal(size=n)
    vec = rng.normal(size=(n, 3))
    score = sum(e[c] for e, c in zip(EFFECTS, cats)) + price + vec @ VEC_WEIGHTS
    cls = (score > np.median(score)).astype(float)  # balanced: chance is 0.5
    reg = (score - score.mean()) / score.std()
    return [(i, *(int(c[i]) for c in cats), float(price[i]), Vectors.dense(vec[i]),
             float(cls[i]), float(reg[i]), int(i % 5 == 0)) for i in range(n)]


def sign_agreement(y_true, y_pred):
    """Custom metric of the regression head: rows whose prediction has the target's sign."""
    import keras

    same = keras.ops.equal(keras.ops.sign(y_true), keras.ops.sign(y_pred))
    return keras.ops.mean(keras.ops.cast(same, "float32"))


def ids_stay_integers(batch: dict) -> dict:
    """transformation_fn: fail the fit if the reader hands categorical ids over as floats."""
    for col in CATEGORICAL:
        if batch[col].dtype.kind not in "iu":
            raise TypeError(f"{col} reached the worker as {batch[col].dtype}, not integers")
    return batch


def _model():
    import keras

    keras.utils.set_random_seed(0)
    cat_inputs = [keras.Input((1,), dtype="int32", name=c) for c in CATEGORICAL]
    price = keras.Input((1,), name="price")
    vec = keras.Input((3,), name="vec")
    embedded = [keras.layers.Flatten()(keras.layers.Embedding(card, 4)(x))
                for x, card in zip(cat_inputs, CARDINALITIES)]
    hidden = keras.layers.Dense(16, activation="relu")(
        keras.layers.Concatenate()([*embedded, price, vec]))
    return keras.Model([*cat_inputs, price, vec],
                       [keras.layers.Dense(1, activation="sigmoid", name="cls")(hidden),
                        keras.layers.Dense(1, name="reg")(hidden)])


@pytest.fixture(scope="module")
def fitted(spark, tmp_path_factory):
    """(KerasModel, Store, path of the Parquet rows to predict on) of one fit."""
    import keras

    from hvd_spark.data import Store
    from hvd_spark.tensorflow.callbacks import BestModelCheckpoint

    tmp = tmp_path_factory.mktemp("keras_multi_input")
    train = spark.createDataFrame(_rows(ROWS, 0), ["id", *FEATURES, *LABELS, "is_val"])
    unseen = str(tmp / "unseen.parquet")
    spark.createDataFrame(_rows(200, 1), ["id", *FEATURES, *LABELS, "is_val"]) \
        .write.parquet(unseen)
    store = Store.create(str(tmp / "store"))
    # mode="max" keeps the epoch of the HIGHEST val_loss: the first one on a learning
    # model, so the checkpoint's choice shows in the weights (the last epoch's would be
    # what the fit gives without any checkpoint callback). Weights only: the other path
    # (a .keras file) is test_estimators' single-input checkpoint test.
    best = BestModelCheckpoint(monitor="val_loss", mode="max", save_weights_only=True)
    model = KerasEstimator(
        num_proc=2, model=_model(), optimizer=keras.optimizers.Adam(0.02),
        loss={"cls": "binary_crossentropy", "reg": "mse"},
        metrics={"cls": ["accuracy"], "reg": [sign_agreement]},
        custom_objects={"sign_agreement": sign_agreement},
        feature_cols=FEATURES, label_cols=LABELS, validation="is_val", batch_size=16,
        epochs=2, store=store, run_id="multi", checkpoint_callback=best,
        transformation_fn=ids_stay_integers, random_seed=0, verbose=0).fit(train)
    return model, store, unseen


@pytest.fixture(scope="module")
def predictions(fitted, spark) -> np.ndarray:
    """(rows, 2) array of transform's cls and reg columns on the unseen rows, by id."""
    model, _, unseen = fitted
    rows = (model.transform(spark.read.parquet(unseen))
            .select("id", *model.output_columns()).orderBy("id").collect())
    return np.array([[r[c] for c in model.output_columns()] for r in rows])


def test_history_has_losses_and_the_custom_metric_per_epoch_and_loss_falls(fitted):
    model, _, _ = fitted
    history = model.getHistory()
    for key in ("loss", "val_loss", "cls_accuracy", "val_cls_accuracy",
                "reg_sign_agreement", "val_reg_sign_agreement"):
        assert len(history.get(key) or []) == 2, (key, sorted(history))
        assert all(np.isfinite(v) for v in history[key]), (key, history[key])
    assert history["loss"][1] < history["loss"][0], history
    assert history["val_loss"][1] < history["val_loss"][0], history
    assert history["val_cls_accuracy"][1] > 0.75, history["val_cls_accuracy"]
    assert history["val_reg_sign_agreement"][1] > 0.75, history["val_reg_sign_agreement"]


def test_checkpoint_callback_kept_the_epoch_it_monitors(fitted):
    import pickle

    model, store, _ = fitted
    val_loss = model.getHistory()["val_loss"]
    chosen = int(np.argmax(val_loss))  # mode="max"
    assert chosen == 0, val_loss
    per_epoch = [pickle.loads(store.read_bytes(
        f"{store.checkpoints_path('multi')}/epoch-{e:06d}.ckpt"))["weights"] for e in (0, 1)]
    got = model.getModel().get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(got, per_epoch[chosen], strict=True))
    assert not all(np.allclose(a, b) for a, b in zip(got, per_epoch[1 - chosen], strict=True))


@pytest.mark.smoke
def test_transform_matches_the_keras_model_and_beats_chance(fitted, predictions, spark):
    model, _, unseen = fitted
    got = predictions
    rows = spark.read.parquet(unseen).orderBy("id").collect()
    x = (*[np.array([[r[c]] for r in rows], np.int64) for c in CATEGORICAL],
         np.array([[r["price"]] for r in rows], np.float32),
         np.array([r["vec"].toArray() for r in rows], np.float32))
    want = np.concatenate([np.asarray(o) for o in model.getModel()(x, training=False)], axis=1)
    assert got.shape == (200, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The kept weights are the first epoch's (see the fixture): still well above chance.
    labels = np.array([r["cls"] for r in rows])
    assert np.mean((got[:, 0] > 0.5) == labels) > 0.7
    assert np.mean(np.sign(got[:, 1]) == np.sign([r["reg"] for r in rows])) > 0.7


def test_saved_model_predicts_the_same_in_a_fresh_process(fitted, predictions, tmp_path):
    model, _, unseen = fitted
    saved, out = str(tmp_path / "model"), tmp_path / "predictions.json"
    model.write().save(saved)
    script = textwrap.dedent("""
        import json, sys
        from pyspark.sql import SparkSession
        from hvd_spark.estimator import KerasModel

        saved, data, out = sys.argv[1:4]
        spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
                 .getOrCreate())
        model = KerasModel.load(saved)
        cols = model.output_columns()
        rows = (model.transform(spark.read.parquet(data)).select("id", *cols)
                .orderBy("id").collect())
        with open(out, "w") as f:
            json.dump({"cols": cols, "rows": [[r[c] for c in cols] for r in rows]}, f)
        spark.stop()
    """)
    done = subprocess.run([sys.executable, "-c", script, saved, unseen, str(out)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    fresh = json.loads(out.read_text())
    assert fresh["cols"] == ["cls__output", "reg__output"]
    np.testing.assert_allclose(np.array(fresh["rows"]), predictions, rtol=1e-6, atol=1e-6)
