"""MLflow tracking of fits and of ``run(fn)``, against a ``sqlite:`` store in a temp dir.

One TorchEstimator fit inside ``mlflow.start_run()`` is read back through
``MlflowClient`` (params, per-epoch metrics, tags, logs, the model), the logged model
is served through ``mlflow.pyfunc`` and ``spark_udf`` against ``transform``; a
TrainValidationSplit gives one child run per param map; rank 0 of ``run(fn)`` logs into
the driver's run.
"""

from __future__ import annotations

import json

import mlflow
import numpy as np
import pytest


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(300, 4))
    y = x @ np.array([0.5, -1.0, 0.25, 2.0]) + 0.1
    rows = [(i, a.tolist(), float(b)) for i, (a, b) in enumerate(zip(x, y))]
    return spark.createDataFrame(rows, "id long, features array<double>, label double")


def _estimator(tmp_path, **overrides):
    import torch

    from hvd_spark.estimator import TorchEstimator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    kwargs = dict(num_proc=2, model=model,
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                  loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["label"],
                  validation=0.2, batch_size=32, epochs=2, random_seed=1, verbose=0,
                  store=str(tmp_path / "store"))
    kwargs.update(overrides)
    return TorchEstimator(**kwargs)


@pytest.mark.smoke
def test_fit_in_a_run_logs_params_metrics_tags_logs_and_a_servable_model(
        spark, df, mlflow_client, tmp_path):
    est = _estimator(tmp_path)
    with mlflow.start_run() as run:
        model = est.fit(df)
    run_id = run.info.run_id
    data = mlflow_client.get_run(run_id).data

    params = data.params
    assert params["optimizer"] == "SGD"
    assert float(params["optimizer.lr"]) == 0.05
    assert float(params["optimizer.momentum"]) == 0.9
    assert params["model"] == "Sequential"
    assert params["model_parameters"] == str(4 * 8 + 8 + 8 + 1)
    assert params["loss"] == "MSELoss"
    assert params["feature_cols"] == "features" and params["label_cols"] == "label"
    assert params["epochs"] == "2" and params["batch_size"] == "32"
    assert params["num_proc"] == "2"
    assert not any(v.startswith("<") or "object at 0x" in v for v in params.values())

    for name in ("loss", "val_loss"):
        history = mlflow_client.get_metric_history(run_id, name)
        assert [m.step for m in history] == [1, 2], name
    losses = [m.value for m in mlflow_client.get_metric_history(run_id, "loss")]
    assert losses == pytest.approx([r["loss"] for r in model.records])

    assert data.tags["hvd_spark.run_id"] == model.getRunId()
    assert data.tags["hvd_spark.estimator"] == "TorchEstimator"
    assert "store" in data.tags["hvd_spark.store"] and data.tags["hvd_spark.data"] == "store"
    (logged,) = mlflow_client.get_run(run_id).inputs.dataset_inputs  # the fit's lineage
    tags = {t.key: t.value for t in logged.tags}
    assert tags["mlflow.data.context"] == "training"
    assert tags["hvd_spark.validation"] == "fraction 0.2"
    assert logged.dataset.source_type == "code"  # built by createDataFrame: no table, no files
    assert logged.dataset.digest
    assert "features" in {f["name"] for f in json.loads(logged.dataset.schema)["mlflow_colspec"]}
    logs = [f.path for f in mlflow_client.list_artifacts(run_id, "logs")]
    assert any("tfevents" in p for p in logs), logs

    uri = f"runs:/{run_id}/model"
    info = mlflow.models.get_model_info(uri)
    assert info.signature.inputs.input_names() == ["features"]
    assert info.signature.outputs.input_names() == ["label__output"]
    expected = (model.transform(df).orderBy("id").select("label__output")
                .toPandas()["label__output"].to_numpy())
    pdf = df.orderBy("id").toPandas()
    got = mlflow.pyfunc.load_model(uri).predict(pdf[["features"]])
    np.testing.assert_allclose(got["label__output"].to_numpy(), expected, atol=1e-6)

    udf = mlflow.pyfunc.spark_udf(spark, uri, env_manager="local")
    served = (df.withColumn("p", udf("features")).orderBy("id").select("p")
              .toPandas()["p"].to_numpy())
    np.testing.assert_allclose(served, expected, atol=1e-6)


def test_train_validation_split_nests_one_child_run_per_param_map(df, mlflow_client, tmp_path):
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import ParamGridBuilder, TrainValidationSplit

    est = _estimator(tmp_path, epochs=1, validation=None)
    grid = ParamGridBuilder().addGrid(est.batch_size, [16, 64]).build()
    tvs = TrainValidationSplit(
        estimator=est, estimatorParamMaps=grid, trainRatio=0.75, seed=3,
        evaluator=RegressionEvaluator(predictionCol="label__output", labelCol="label"))
    with mlflow.start_run() as parent:
        tuned = tvs.fit(df)

    children = mlflow_client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(c.data.params["batch_size"] for c in children) == ["16", "64"]
    for child in children:
        assert child.info.status == "FINISHED"
        assert [m.step for m in mlflow_client.get_metric_history(child.info.run_id, "loss")] == [1]
        assert mlflow_client.list_artifacts(child.info.run_id, "model")
    # Spark ML refits the best map on all rows with a plain fit: in the tuning run itself.
    best = str(tuned.bestModel.getOrDefault("batch_size"))
    assert mlflow_client.get_run(parent.info.run_id).data.params["batch_size"] == best


def _log_from_rank_zero():
    import os

    import mlflow

    run_id = os.environ.get("MLFLOW_RUN_ID")  # read first: MLflow unsets it once used
    if os.environ["HVD_SPARK_RANK"] == "0":
        mlflow.log_metric("from_rank_0", 1.5, step=3)
    return run_id


def test_run_fn_rank_zero_logs_into_the_drivers_run(spark, mlflow_client):
    import hvd_spark

    with mlflow.start_run() as run:
        seen = hvd_spark.run(_log_from_rank_zero, num_proc=2, verbose=0)
    assert seen == [run.info.run_id] * 2
    [metric] = mlflow_client.get_metric_history(run.info.run_id, "from_rank_0")
    assert (metric.value, metric.step) == (1.5, 3)
    assert mlflow_client.get_run(run.info.run_id).info.status == "FINISHED"
