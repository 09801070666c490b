"""When a fit is tracked in MLflow, what it logs as params, and the run's way to the ranks.

No Spark job: the Estimators' fit is replaced by a stand-in where a fit would run; the
store is ``sqlite:`` in the test's directory.
"""

from __future__ import annotations

import functools

import mlflow
import pytest

from hvd_spark.errors import ConfigError
from hvd_spark.estimator import tracking
from hvd_spark.estimator.mlflow_ranks import nest_mlflow_logger
from hvd_spark.estimator.tracking_params import estimator_params
from hvd_spark.runner import mlflow_env


def _estimator(**overrides):
    import torch

    from hvd_spark.estimator import TorchEstimator

    model = torch.nn.Linear(3, 1)
    kwargs = dict(model=model, loss=torch.nn.functional.mse_loss,
                  optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                  feature_cols=["x"], label_cols=["y"], input_shapes=[[-1, 3]],
                  metrics=[functools.partial(torch.nn.functional.l1_loss)], store="/unused")
    kwargs.update(overrides)
    return TorchEstimator(**kwargs)


def _all_runs(mlflow_client) -> list:
    return mlflow_client.search_runs([e.experiment_id for e in mlflow_client.search_experiments()])


def test_no_run_and_no_autolog_logs_nothing_and_the_fit_goes_on(mlflow_client, monkeypatch):
    est = _estimator()
    monkeypatch.setattr(est, "_fit", lambda df: "the model")
    assert est.fit("a DataFrame") == "the model"
    assert tracking.begin(est) is None
    with mlflow.start_run():
        assert tracking.begin(_estimator(mlflow=False)) is None
    assert [r.data.params for r in _all_runs(mlflow_client)] == [{}]  # only the run started above


def test_mlflow_true_starts_a_run_of_its_own_and_ends_it(mlflow_client):
    with tracking.fit_tracking(_estimator(mlflow=True)) as tracked:
        assert tracked.own and mlflow.active_run().info.run_id == tracked.run_id
    assert mlflow.active_run() is None
    run = mlflow_client.get_run(tracked.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["hvd_spark.estimator"] == "TorchEstimator"
    assert run.data.params["optimizer"] == "Adam"


def test_a_failed_fit_fails_its_own_run_and_an_active_run_is_left_open(mlflow_client):
    with pytest.raises(RuntimeError), tracking.fit_tracking(_estimator(mlflow=True)) as tracked:
        raise RuntimeError("rank 1 died")
    assert mlflow_client.get_run(tracked.run_id).info.status == "FAILED"
    with mlflow.start_run() as run:
        with tracking.fit_tracking(_estimator()) as inner:
            assert inner.run_id == run.info.run_id and not inner.own
        assert mlflow.active_run().info.run_id == run.info.run_id


def test_autolog_makes_a_fit_start_its_own_run(mlflow_client):
    import mlflow.pyspark.ml

    mlflow.pyspark.ml.autolog(log_models=False, silent=True)
    try:
        with tracking.fit_tracking(_estimator()) as tracked:
            assert tracked.own and not tracked.log_models
    finally:
        mlflow.pyspark.ml.autolog(disable=True, silent=True)
    assert tracking.begin(_estimator()) is None


def test_mlflow_param_is_true_false_or_none():
    with pytest.raises(ConfigError, match="mlflow must be True"):
        tracking.begin(_estimator(mlflow="yes"))


def test_params_are_readable_names_and_values():
    params = estimator_params(_estimator(batch_size=16))
    assert params["model"] == "Linear" and params["model_parameters"] == 4
    assert params["optimizer"] == "Adam" and params["optimizer.lr"] == 0.01
    assert params["optimizer.betas"] == "0.9, 0.999"
    assert params["loss"] == "mse_loss" and params["metrics"] == "l1_loss"
    assert params["feature_cols"] == "x" and params["input_shapes"] == "[[-1, 3]]"
    assert params["batch_size"] == 16 and params["store"] == "/unused"
    assert "reader_pool_type" not in params  # Horovod's knobs that do nothing here
    assert "mlflow" not in params and "backend" not in params  # None: not logged


def test_driver_env_names_the_active_run_with_an_absolute_store(mlflow_client, tmp_path,
                                                                 monkeypatch):
    assert mlflow_env.driver_env() == {"MLFLOW_TRACKING_URI": mlflow.get_tracking_uri()}
    with mlflow.start_run() as run:
        env = mlflow_env.driver_env()
    assert env["MLFLOW_RUN_ID"] == run.info.run_id
    assert env["MLFLOW_EXPERIMENT_ID"] == run.info.experiment_id
    monkeypatch.chdir(tmp_path)
    assert mlflow_env.absolute_tracking_uri("sqlite:///m.db") == f"sqlite:///{tmp_path}/m.db"
    assert mlflow_env.absolute_tracking_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert mlflow_env.absolute_tracking_uri("mlruns") == f"{tmp_path}/mlruns"
    assert mlflow_env.absolute_tracking_uri("http://host:5000") == "http://host:5000"
    assert mlflow_env.absolute_tracking_uri("databricks") == "databricks"


def test_lightning_mlflow_logger_nests_under_the_drivers_run(mlflow_client, monkeypatch):
    from lightning.pytorch.loggers import MLFlowLogger

    experiment = mlflow_client.create_experiment("notebook")
    with mlflow.start_run(experiment_id=experiment) as parent:
        env = mlflow_env.driver_env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    logger = MLFlowLogger(tracking_uri=mlflow.get_tracking_uri())
    nest_mlflow_logger([logger])
    logger.log_metrics({"train_loss": 0.5}, step=1)
    child = mlflow_client.get_run(logger.run_id)
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.experiment_id == experiment
    assert child.data.metrics == {"train_loss": 0.5}
