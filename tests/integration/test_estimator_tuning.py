"""Tuning a TorchEstimator with Spark ML on real local Spark.

One ``CrossValidator(parallelism=2)`` over the diagonal of a learning_rate x batch_size
grid (two maps, to keep five fits), based on an optimizer object: two fits at once on
local[2]'s two task slots, each map trained as given, the maps of a fold sharing the
prepared data, the best model carrying its params; saved, then loaded in a fresh Python
process. Every fit is one rank on 200 rows for one epoch.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from pyspark.ml.evaluation import RegressionEvaluator
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

from hvd_spark.errors import ConfigError
from hvd_spark.estimator import TorchEstimator

W = np.array([1.0, -1.0, 0.5])
FOLD_FITS = 4  # 2 folds x 2 param maps, then one refit of the best map
PROBE = [[0.5, -1.0, 2.0], [1.0, 1.0, 1.0]]
DIAGONAL = {(0.02, 20), (0.2, 50)}  # (learning_rate, batch_size) of the maps


@pytest.fixture(scope="module")
def frame(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    rows = [(a.tolist(), float(b)) for a, b in zip(x, x @ W)]
    return spark.createDataFrame(rows, "features array<double>, label double")


def _estimator(store: Path, **overrides) -> TorchEstimator:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    kwargs = dict(num_proc=1, model=model,
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                  loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["label"],
                  batch_size=20, epochs=1, store=str(store), verbose=0, random_seed=0)
    return TorchEstimator(**{**kwargs, **overrides})


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _meeting_minibatch(directory: str):
    """Horovod's train_minibatch_fn: the default step, after the rank's first step has
    waited (up to 120 s) for the other fit of its pair to start too: 'met_<k>' files are
    proof that two fits trained at the same time."""

    def make():
        from hvd_spark.estimator.torch_worker import default_minibatch

        first = [True]

        def step(model, optimizer, *args):
            if first:
                first.clear()
                _meet(directory)
            return default_minibatch(model, optimizer, *args)

        return step

    return make


def _meet(directory: str) -> None:
    arrival = 1
    while True:  # the k-th fit to start claims arrive_<k>
        try:
            os.close(os.open(os.path.join(directory, f"arrive_{arrival}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:
            arrival += 1
    if arrival > FOLD_FITS:
        return  # the refit of the best map runs alone
    partner = arrival + 1 if arrival % 2 else arrival - 1
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if os.path.exists(os.path.join(directory, f"arrive_{partner}")):
            Path(directory, f"met_{arrival}").touch()
            return
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cv_fit(frame, tmp_path_factory):
    import torch

    root = tmp_path_factory.mktemp("cv")
    meetings = root / "meetings"
    meetings.mkdir()
    est = _estimator(root / "store", train_minibatch_fn=_meeting_minibatch(str(meetings)))
    adam = torch.optim.Adam(est.getModel().parameters(), lr=0.01)
    # An optimizer object in every map: saving it failed with "Object of type Adam is not
    # JSON serializable".
    full = (ParamGridBuilder().baseOn({est.optimizer: adam})
            .addGrid(est.learning_rate, [0.02, 0.2]).addGrid(est.batch_size, [20, 50]).build())
    grid = [m for m in full if (m[est.learning_rate], m[est.batch_size]) in DIAGONAL]
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=2, parallelism=2,
                        seed=1, collectSubModels=True,
                        evaluator=RegressionEvaluator(labelCol="label",
                                                      predictionCol="label__output"))
    writer = logging.getLogger("hvd_spark.data.writer")
    messages, level = _Messages(), writer.level
    writer.addHandler(messages)
    writer.setLevel(logging.INFO)
    try:
        cv_model = cv.fit(frame)
    finally:
        writer.removeHandler(messages)
        writer.setLevel(level)
    return cv_model, est, adam, meetings, messages.lines, root


@pytest.mark.smoke
def test_cross_validator_fits_two_param_maps_at_once(cv_fit):
    cv_model, *_, meetings, _, _ = cv_fit
    met = sorted(p.name for p in meetings.glob("met_*"))
    assert met == sorted(f"met_{k}" for k in range(1, FOLD_FITS + 1)), "pairs of fits overlapped"
    assert np.isfinite(cv_model.avgMetrics).all(), "every fit succeeded"
    assert len(set(cv_model.avgMetrics)) == len(cv_model.avgMetrics), "with distinct results"


def test_each_param_map_trains_as_given_and_its_model_says_so(cv_fit):
    cv_model, est, adam, *_ = cv_fit
    for fold in cv_model.subModels:
        weights = set()
        for params, model in zip(cv_model.getEstimatorParamMaps(), fold):
            rate, batch = params[est.learning_rate], params[est.batch_size]
            assert (model.getLearningRate(), model.getBatchSize(), model.getEpochs()) == \
                (rate, batch, 1)
            trained = model.getOptimizer()  # the map's Adam, trained at the map's rate
            assert type(trained) is type(adam)
            assert trained.param_groups[0]["lr"] == pytest.approx(rate)
            weights.add(tuple(model.getModel().weight.detach().numpy().round(6).ravel()))
        assert len(weights) == len(fold), "every map trained differently"
    assert adam.param_groups[0]["lr"] == 0.01, "the user's optimizer is unchanged"
    best = cv_model.bestModel
    winner = cv_model.getEstimatorParamMaps()[int(np.argmin(cv_model.avgMetrics))]
    assert (best.getLearningRate(), best.getBatchSize(), best.getRandomSeed()) == \
        (winner[est.learning_rate], winner[est.batch_size], 0)


def test_the_param_maps_of_a_fold_share_the_prepared_data(cv_fit):
    *_, lines, root = cv_fit
    wrote = [line for line in lines if line.startswith("wrote dataset")]
    reused = [line for line in lines if line.startswith("reusing dataset")]
    # Fold 1's, fold 2's and the refit's training rows; each fold's second map reused them.
    assert (len(wrote), len(reused)) == (3, 2), lines
    assert len(list((root / "store" / "intermediate_train_data").iterdir())) == 3


_LOAD = textwrap.dedent("""
    import json, sys
    import torch
    from pyspark.sql import SparkSession

    root = sys.argv[1]
    SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
    from pyspark.ml.tuning import CrossValidatorModel

    from hvd_spark.estimator import TorchEstimator, TorchModel

    cv = CrossValidatorModel.load(root + "/cv")
    est = cv.getEstimator()
    own = {id(p) for p in est.getModel().parameters()}
    optimizers = [m[est.getParam("optimizer")] for m in cv.getEstimatorParamMaps()]
    maps = [[type(v).__name__, v.param_groups[0]["lr"],
             all(id(p) in own for g in v.param_groups for p in g["params"])]
            for v in optimizers]
    best = TorchModel.load(root + "/best")
    alone = TorchEstimator.load(root + "/estimator")
    probe = torch.tensor(json.loads(sys.argv[2]))
    print(json.dumps({
        "maps": maps, "shared": len({id(v) for v in optimizers}), "avg": list(cv.avgMetrics),
        "best": [type(cv.bestModel.getOptimizer()).__name__, cv.bestModel.getLearningRate(),
                 cv.bestModel.getBatchSize(), cv.bestModel.getEpochs()],
        "predict": cv.bestModel.getModel()(probe).detach().tolist(),
        "predict_saved_alone": best.getModel()(probe).detach().tolist(),
        "estimator": [type(alone.getOptimizer()).__name__,
                      alone.getOptimizer().param_groups[0]["lr"], alone.getLearningRate()],
    }))
""")


def test_saved_tuning_loads_in_a_fresh_process(cv_fit):
    import torch

    cv_model, est, *_, root = cv_fit
    # Failed: "Object of type Adam is not JSON serializable".
    cv_model.write().option("persistSubModels", "false").save(str(root / "cv"))
    cv_model.bestModel.write().save(str(root / "best"))
    est.write().save(str(root / "estimator"))
    # From the repository root: the saved estimator's train_minibatch_fn is this module's.
    done = subprocess.run([sys.executable, "-c", _LOAD, str(root), json.dumps(PROBE)],
                          capture_output=True, text=True, timeout=300, check=False,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    # The maps' optimizer: one object, over the loaded estimator's model (it fits again).
    assert loaded["maps"] == [["Adam", 0.01, True]] * 2 and loaded["shared"] == 1
    assert loaded["avg"] == list(cv_model.avgMetrics)
    best = cv_model.bestModel
    assert loaded["best"] == ["Adam", best.getLearningRate(), best.getBatchSize(), 1]
    expected = best.getModel()(torch.tensor(PROBE)).detach().tolist()
    assert np.allclose(loaded["predict"], expected)
    assert np.allclose(loaded["predict_saved_alone"], expected)
    assert loaded["estimator"] == ["SGD", 0.01, None]


def test_saving_a_param_that_cannot_be_pickled_names_it(spark, tmp_path):
    lock = threading.Lock()
    est = _estimator(tmp_path / "store", transformation_fn=lambda batch: (lock, batch)[1])
    with pytest.raises(ConfigError, match="transformation_fn value cannot be pickled"):
        est.write().save(str(tmp_path / "est"))
