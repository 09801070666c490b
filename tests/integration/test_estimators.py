"""TorchEstimator and KerasEstimator on real local Spark (num_proc=2): fit, transform,
validation, resume by run_id, save/load and Pipeline use, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.feature import VectorAssembler
from pyspark.sql import functions as F
from pyspark.sql import types as T

from hvd_spark.errors import ConfigError, DataError
from hvd_spark.estimator import KerasEstimator, KerasModel, TorchEstimator, TorchModel

W = np.array([1.5, -2.0, 0.75, 0.0])


def _rows(n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    y = (x @ W > 0).astype(int)
    return [(float(a), float(b), float(c), float(d), int(label), int(i % 5 == 0))
            for i, ((a, b, c, d), label) in enumerate(zip(x, y))]


@pytest.fixture(scope="module")
def frames(spark):
    schema = "a double, b double, c double, d double, label long, is_val long"
    train = spark.createDataFrame(_rows(1200, 0), schema)
    test = spark.createDataFrame(_rows(300, 1), schema)
    assemble = VectorAssembler(inputCols=["a", "b", "c", "d"], outputCol="features")
    return assemble.transform(train), assemble.transform(test), assemble


def _accuracy(predictions, column: str) -> float:
    rows = predictions.select("label", column).collect()
    pred = [int(np.argmax(r[column])) if isinstance(r[column], list) else int(r[column] > 0.5)
            for r in rows]
    return float(np.mean([p == r["label"] for p, r in zip(pred, rows)]))


def _torch_estimator(tmp_path, **overrides):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    kwargs = dict(num_proc=2, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.02),
                  loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"],
                  label_cols=["label"], batch_size=32, epochs=3, store=str(tmp_path / "store"),
                  verbose=1)
    kwargs.update(overrides)
    return TorchEstimator(**kwargs)


@pytest.fixture(scope="module")
def torch_fit(frames, tmp_path_factory):
    train, _, _ = frames

    def accuracy(out, label):  # local: shipped to the ranks by value
        return (out.argmax(1) == label).float().mean()

    est = _torch_estimator(tmp_path_factory.mktemp("torch"), validation="is_val", run_id="t1",
                           metrics=[accuracy])
    return est, est.fit(train)


@pytest.mark.smoke
def test_torch_learns_and_transform_schema(torch_fit, frames):
    _, model = torch_fit
    _, test, _ = frames
    out = model.transform(test)
    field = out.schema["label__output"]
    assert field.dataType == T.ArrayType(T.DoubleType())
    assert set(test.columns) <= set(out.columns)
    assert out.count() == test.count()
    assert _accuracy(out, "label__output") > 0.9


def test_torch_history_has_validation_per_epoch(torch_fit):
    _, model = torch_fit
    history = model.getHistory()  # Horovod's torch shape
    assert [h["epoch"] for h in history] == [0, 1, 2]
    assert all(set(h) == {"epoch", "train", "validation"} for h in history)
    assert all(h["validation"]["loss"] > 0 for h in history)
    assert history[-1]["train"]["loss"] < history[0]["train"]["loss"]


def test_torch_metrics_have_keras_names_and_epochs_count_from_one(torch_fit):
    est, model = torch_fit
    assert est.getDryRun() is True  # this fit passed the dry run before writing its data
    horovods = model.getHistory()[-1]  # Horovod's names, epochs from 0 (its own)
    assert horovods["epoch"] == 2
    assert set(horovods["validation"]["all_metrics"][0]) == {"group_0_label"}
    records = model.getEpochHistory()  # as the console shows them: epochs from 1
    assert [r["epoch"] for r in records] == [1, 2, 3]
    last = records[-1]
    assert last["accuracy"] == last["group_0_label"] == horovods["train"]["all_metrics"][0][
        "group_0_label"]
    assert last["val_accuracy"] == last["val_group_0_label"] > 0.9


def test_torch_save_load_identical_predictions(torch_fit, frames, tmp_path):
    _, model = torch_fit
    _, test, _ = frames
    model.save(str(tmp_path / "m"))
    loaded = TorchModel.load(str(tmp_path / "m"))
    assert loaded.getHistory() == model.getHistory()
    a = [r["label__output"] for r in model.transform(test).orderBy("a").collect()]
    b = [r["label__output"] for r in loaded.transform(test).orderBy("a").collect()]
    assert a == b


def test_torch_in_pipeline_saves_and_loads(frames, tmp_path):
    train, test, assemble = frames
    raw_train = train.drop("features")
    est = _torch_estimator(tmp_path, epochs=1, output_cols=["scores"])
    fitted = Pipeline(stages=[assemble, est]).fit(raw_train)
    assert est.getRunId() is None, "a generated run id must not make the next fit resume"
    assert fitted.stages[-1].getRunId().startswith("run_")
    fitted.write().overwrite().save(str(tmp_path / "pipe"))
    loaded = PipelineModel.load(str(tmp_path / "pipe"))
    raw_test = test.drop("features")
    a = [r["scores"] for r in fitted.transform(raw_test).orderBy("a").collect()]
    b = [r["scores"] for r in loaded.transform(raw_test).orderBy("a").collect()]
    assert a == b and len(a) == 300


def test_torch_resume_by_run_id(frames, tmp_path):
    train, _, _ = frames
    first = _torch_estimator(tmp_path, epochs=2, run_id="resume", validation=0.2).fit(train)
    second = _torch_estimator(tmp_path, epochs=3, run_id="resume", validation=0.2).fit(train)
    h1, h2 = first.getHistory(), second.getHistory()
    assert len(h1) == 2 and len(h2) == 3
    assert h2[:2] == h1, "the second fit must continue from the checkpoint, not start over"


def test_bad_parameters_fail_before_training(frames, tmp_path):

    train, _, _ = frames
    with pytest.raises(ConfigError, match="unknown parameter.*'lr'"):
        _torch_estimator(tmp_path, lr=0.1)
    with pytest.raises(ConfigError, match="optimizer must be a torch.optim.Optimizer"):
        _torch_estimator(tmp_path, optimizer="adam").fit(train)
    with pytest.raises(ConfigError, match="epochs must be >= 1"):
        _torch_estimator(tmp_path, epochs=0).fit(train)
    with pytest.raises(DataError, match="nope"):
        _torch_estimator(tmp_path, feature_cols=["nope"]).fit(train)
    with pytest.raises(ConfigError, match="loss"):
        est = _torch_estimator(tmp_path)
        est._paramMap.pop(est.loss)
        est.fit(train)


def test_keras_learns_saves_and_loads(frames, tmp_path):
    import keras

    train, test, _ = frames
    train = train.withColumn("label_f", F.col("label").cast("double"))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    est = KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.Adam(0.02),
                         loss="binary_crossentropy", metrics=["accuracy"],
                         feature_cols=["features"], label_cols=["label_f"], batch_size=32,
                         epochs=3, validation=0.2, store=str(tmp_path / "store"))
    fitted = est.fit(train)
    history = fitted.getHistory()  # Horovod's Keras shape: metric -> value per epoch
    assert len(history["loss"]) == 3 and len(history["val_loss"]) == 3
    assert history["accuracy"][-1] > 0.9
    out = fitted.transform(test)
    assert out.schema["label_f__output"].dataType == T.DoubleType()
    assert _accuracy(out, "label_f__output") > 0.9
    fitted.save(str(tmp_path / "k"))
    loaded = KerasModel.load(str(tmp_path / "k"))
    a = [r["label_f__output"] for r in out.orderBy("a").collect()]
    b = [r["label_f__output"] for r in loaded.transform(test).orderBy("a").collect()]
    assert np.allclose(a, b)


def test_torch_keeps_the_optimizers_param_groups(frames, tmp_path):
    import torch

    train, _, _ = frames
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    first, last = model[0], model[2]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD([{"params": first.parameters(), "lr": 0.0},
                                 {"params": last.parameters(), "lr": 0.1}], momentum=0.9)
    fitted = _torch_estimator(tmp_path, model=model, optimizer=optimizer, epochs=1).fit(train)
    after = fitted.getModel().state_dict()
    assert torch.equal(after["0.weight"], before["0.weight"]), "lr=0 group must not move"
    assert not torch.equal(after["2.weight"], before["2.weight"]), "lr=0.1 group must move"
    trained = fitted.getOptimizer()
    assert [g["lr"] for g in trained.param_groups] == [0.0, 0.1]
    assert all(g["momentum"] == 0.9 for g in trained.param_groups)
    assert trained.param_groups[1]["params"][0] is fitted.getModel()[2].weight
    assert trained.state[fitted.getModel()[2].weight]["momentum_buffer"] is not None


def test_torch_transformation_fn_applies_to_every_batch(frames, tmp_path):
    train, test, _ = frames

    def invert_labels(batch):  # Horovod's transformation_fn, on a dict of numpy arrays
        batch["label"] = 1 - batch["label"]
        return batch

    fitted = _torch_estimator(tmp_path, transformation_fn=invert_labels, epochs=2,
                              inmemory_cache_all=True).fit(train)
    assert _accuracy(fitted.transform(test), "label__output") < 0.1


def test_torch_input_shapes_that_do_not_fit_the_column_name_it(frames, tmp_path):
    train, _, _ = frames
    with pytest.raises(ConfigError, match=r"input_shapes \(column 'features'\).*holds 5 values"):
        _torch_estimator(tmp_path, input_shapes=[[-1, 5]]).fit(train)


def test_torch_fit_on_parquet_with_horovods_prepare_data(frames, tmp_path):
    from hvd_spark.data import LocalStore
    from hvd_spark.data.dataset_index import prepare_data

    train, test, _ = frames
    store = LocalStore(str(tmp_path / "store"))
    est = _torch_estimator(tmp_path, store=store, num_proc=None, input_shapes=[[-1, 4]])
    est.setBackend(hvd_spark_backend(2))
    with prepare_data(2, store, train, label_columns=["label"], feature_columns=["features"],
                      validation=0.2) as dataset_idx:
        fitted = est.fit_on_parquet(dataset_idx=dataset_idx)
    assert _accuracy(fitted.transform(test), "label__output") > 0.9
    assert "validation" in fitted.getHistory()[-1]


def hvd_spark_backend(num_proc: int):
    from hvd_spark import SparkBackend

    return SparkBackend(num_proc=num_proc)


def test_keras_checkpoint_callback_label_shapes_and_backend_env(frames, tmp_path):
    import os
    import pickle

    import keras

    from hvd_spark.data import Store

    train, _, _ = frames
    train = train.withColumn("label_f", F.col("label").cast("double"))

    class NeedsEnv(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            if os.environ.get("HVD_SPARK_TEST_FLAG") != "on":
                raise RuntimeError("backend_env did not reach the rank")

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
    # The best epoch by the highest loss is the first: the fitted model must get its weights.
    best = keras.callbacks.ModelCheckpoint("best.keras", monitor="loss", mode="max",
                                           save_best_only=True)
    store = Store.create(str(tmp_path / "store"))
    fitted = KerasEstimator(
        num_proc=2, model=model, optimizer=keras.optimizers.Adam(0.05),
        loss="binary_crossentropy", loss_weights=[1.0], feature_cols=["features"],
        label_cols=["label_f"], label_shapes=[[-1, 1]], batch_size=32, epochs=3, store=store,
        run_id="kc", checkpoint_callback=best, callbacks=[NeedsEnv()],
        backend_env={"HVD_SPARK_TEST_FLAG": "on"}, verbose=0).fit(train)
    history = fitted.getHistory()
    assert history["loss"][0] > history["loss"][-1]
    first = pickle.loads(store.read_bytes(f"{store.checkpoints_path('kc')}/epoch-000000.ckpt"))
    last = pickle.loads(store.latest_checkpoint("kc")[1])
    got = fitted.getModel().get_weights()
    assert all(np.allclose(a, b) for a, b in zip(got, first["weights"]))
    assert not all(np.allclose(a, b) for a, b in zip(got, last["weights"]))


def test_torch_train_minibatch_fn_replaces_the_step(frames, tmp_path):
    import torch

    train, _, _ = frames

    def make_minibatch():  # Horovod's train_minibatch_fn: returns the per-batch function
        def forward_only(model, optimizer, transform_outputs, loss_fn, inputs, labels,
                         sample_weights, backward_passes_per_step, batch_idx):
            outputs, labels = transform_outputs(model(*inputs), labels)
            return outputs, loss_fn(outputs, labels, sample_weights)

        return forward_only

    est = _torch_estimator(tmp_path, train_minibatch_fn=make_minibatch, epochs=1)
    before = {k: v.clone() for k, v in est.getModel().state_dict().items()}
    after = est.fit(train).getModel().state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "no step: weights unchanged"


def test_keras_model_input_that_does_not_fit_the_column_names_it(frames, tmp_path):
    import keras

    train, _, _ = frames
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    est = KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.SGD(),
                         loss="mse", feature_cols=["features"], label_cols=["label"],
                         store=str(tmp_path / "store"))
    with pytest.raises(ConfigError, match="feature column 'features' holds 4 values per row"):
        est.fit(train)


def test_torch_fit_on_parquet_the_user_wrote_to_the_train_path(frames, tmp_path):
    from pyspark.ml.functions import vector_to_array

    from hvd_spark.data import LocalStore

    train, test, _ = frames
    store = LocalStore(str(tmp_path / "store"))
    (train.select(vector_to_array("features").alias("features"), "label")
     .write.parquet(store.get_train_data_path()))
    fitted = _torch_estimator(tmp_path, store=store).fit_on_parquet()  # Horovod's default
    assert _accuracy(fitted.transform(test), "label__output") > 0.9


def test_torch_trains_through_any_launcher(frames, tmp_path):
    """The one seam: an Estimator's ranks start through a Launcher, here local processes
    (LocalJob) behind the Backend adapter instead of Spark barrier tasks."""
    from hvd_spark.runner.backend import LauncherBackend
    from hvd_spark.runner.local.local_launcher import LocalJob
    from hvd_spark.runner.run_config import RunConfig

    class CountedLocalJob(LocalJob):
        started: list[int] = []

        def start(self, command=None):
            type(self).started.append(self.num_proc)
            super().start(command)

    train, test, _ = frames
    backend = LauncherBackend(CountedLocalJob, RunConfig.from_kwargs(num_proc=2, verbose=0))
    fitted = _torch_estimator(tmp_path, num_proc=None, backend=backend, epochs=2).fit(train)
    assert CountedLocalJob.started == [2]
    assert _accuracy(fitted.transform(test), "label__output") > 0.9


def test_expensive_work_waits_for_slots_pickling_and_a_writable_store(frames, tmp_path):
    import threading

    import torch

    train, _, _ = frames
    store = tmp_path / "store"
    with pytest.raises(ConfigError, match=r"num_proc=3 but the cluster runs at most 2"):
        _torch_estimator(tmp_path, num_proc=3).fit(train)
    model = torch.nn.Linear(4, 2)
    model.lock = threading.Lock()  # cannot be pickled
    with pytest.raises(ConfigError, match=r"^model cannot be pickled"):
        _torch_estimator(tmp_path, model=model,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).fit(train)
    assert not any(store.rglob("*.parquet"))  # refused before the dataset was written
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"cannot write there"):
        _torch_estimator(tmp_path, store=str(blocker / "store")).fit(train)


def test_torch_use_gpu_asked_for_without_gpus_warns_once(frames, tmp_path):
    train, _, _ = frames
    est = _torch_estimator(tmp_path, use_gpu=True, epochs=1, verbose=0)
    with pytest.warns(UserWarning, match=r"TorchEstimator\(use_gpu=True\): none of the 2 "
                                         "ranks saw a GPU, so training ran on the CPU") as got:
        est.fit(train)
    assert len([w for w in got if "saw a GPU" in str(w.message)]) == 1
