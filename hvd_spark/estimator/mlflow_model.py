"""A fitted Estimator's Model as an MLflow model: the ``python_function`` (pyfunc) flavour.

The Spark ML model's own files (``model.write().save(...)``) travel as the MLflow
model's artifact; ``HvdPyfuncModel`` loads them back as the model class's ``load`` does
and predicts on a pandas DataFrame with the model's predictor function, the one
``transform`` runs in its UDF, so no SparkSession is needed to predict and the
numbers are ``transform``'s. ``mlflow.pyfunc.spark_udf`` serves it on Spark.

Only imported when MLflow is in use (``hvd_spark.estimator.tracking``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow.models import ModelSignature, infer_signature
from mlflow.types import ColSpec, DataType, Schema
from mlflow.types.schema import Array

#: Name of the artifact holding the Spark ML model's files.
ARTIFACT = "hvd_model"
#: Packages a model of each class needs to predict, besides the common ones.
_FRAMEWORK_PACKAGES = {
    "TorchModel": ("torch",),
    "LightningModel": ("torch", "lightning"),
    "KerasModel": ("keras", "tensorflow", "tensorflow-cpu"),
}
_COMMON_PACKAGES = ("hvd-spark", "pyspark", "cloudpickle", "numpy", "pandas", "pyarrow")


def _feature_array(series: pd.Series) -> np.ndarray:
    """A pandas column -> one numpy array, as ``transform`` feeds the model.

    Scalars keep their dtype; array cells (lists, numpy arrays or ML Vectors) are
    stacked, float32 unless they hold integers (ids keep their type), as in training.
    """
    if len(series) == 0:
        return series.to_numpy()
    first = series.iloc[0]
    if hasattr(first, "toArray"):  # a Spark ML Vector from toPandas()
        series = series.map(lambda v: v.toArray())
        first = series.iloc[0]
    if isinstance(first, (list, tuple, np.ndarray)):
        stacked = np.stack([np.asarray(v) for v in series])
        return stacked if stacked.dtype.kind in "iu" else stacked.astype(np.float32)
    return series.to_numpy()


class HvdPyfuncModel(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper of a saved ``HvdModel`` (TorchModel, KerasModel, LightningModel)."""

    def load_context(self, context: Any) -> None:
        """Load the Spark ML model's files and build its predictor (no SparkSession)."""
        from hvd_spark.estimator.persistence import load_saved

        self._model = load_saved(context.artifacts[ARTIFACT])
        self._predict = self._model.predictor_factory()(self._model.model_bytes)

    def predict(self, context: Any, model_input: pd.DataFrame,
                params: dict[str, Any] | None = None) -> pd.DataFrame | np.ndarray:
        """Predict on the feature columns of ``model_input``.

        Args:
            context: MLflow's model context (unused after ``load_context``).
            model_input: Holds the model's feature columns (scalars or arrays per row).
            params: Unused.

        Returns:
            One column per model output, named as ``transform`` names them: a float per
            row for a one-value output, else an array of floats per row. A model with one
            output of several values gives a ``(rows, values)`` float array instead: the
            form ``mlflow.pyfunc.spark_udf`` turns into an array per row (it drops a column
            of arrays).
        """
        model = self._model
        features = model.value("feature_columns")
        missing = [c for c in features if c not in model_input.columns]
        if missing:
            raise ValueError(f"the input lacks the feature column(s) {missing}; it has "
                             f"{list(model_input.columns)}")
        inputs = [_feature_array(model_input[c]) for c in features]
        # transform's batching (tuning.rows_per_call)
        rows = len(model_input)
        batch = model.value("transform_batch_size") or model.value("batch_size")
        names, shapes = model.output_columns(), model.output_shapes
        parts: list[list[np.ndarray]] = [[] for _ in names]
        for start in range(0, rows, batch):  # the batches transform runs
            outs = self._predict([x[start : start + batch] for x in inputs])
            for i, out in enumerate(outs):
                parts[i].append(np.asarray(out, dtype=np.float64))
        frame: dict[str, Any] = {}
        for i, name in enumerate(names):
            width = max(1, math.prod(shapes[i])) if i < len(shapes) else 1
            values = np.concatenate(parts[i]).reshape(rows, -1) if rows else np.zeros((0, width))
            if not _scalar(shapes, i) and len(names) == 1:
                return values
            frame[name] = values.reshape(-1) if _scalar(shapes, i) else list(values)
        return pd.DataFrame(frame, index=model_input.index)


def _scalar(shapes: list[tuple[int, ...]], i: int) -> bool:
    """Whether output ``i`` is one value per row (as ``transform`` decides)."""
    return math.prod(shapes[i]) <= 1 if i < len(shapes) else False


def output_schema(model: Any) -> Schema:
    """One double column per one-value output, an array of doubles otherwise."""
    shapes = model.output_shapes
    return Schema([ColSpec(DataType.double if _scalar(shapes, i) else Array(DataType.double),
                           name) for i, name in enumerate(model.output_columns())])


def _spec_type(dtype: str, dims: int) -> Any:
    kind = np.dtype(dtype).kind
    out: Any = (DataType.long if kind in "iu" else DataType.boolean if kind == "b"
                else DataType.double)
    for _ in range(dims):
        out = Array(out)
    return out


def signature(model: Any, df: Any = None, dataset: Any = None) -> ModelSignature:
    """The model's signature: inputs from the DataFrame's schema (else from the stored
    dataset's columns, for ``fit_on_parquet``), outputs from the model's output shapes."""
    features = list(model.value("feature_columns"))
    if df is not None:
        inputs = infer_signature(df.select(*features)).inputs  # schema only, no job
    else:
        cols = [dataset.column(c) for c in features]
        inputs = Schema([ColSpec(_spec_type(c.dtype, len(c.shape)), c.name) for c in cols])
    return ModelSignature(inputs=inputs, outputs=output_schema(model))


def requirements(model: Any) -> list[str]:
    """Pinned pip requirements of the installed packages the model needs to predict.

    Given explicitly, so MLflow does not load the model in a subprocess to infer them.
    """
    wanted = _COMMON_PACKAGES + _FRAMEWORK_PACKAGES.get(type(model).__name__, ())
    out = []
    for name in wanted:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue  # e.g. tensorflow where tensorflow-cpu is installed
    return out


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No "Downloading artifacts" bars (MLflow copies the local artifacts with them) nor the
    input-example warning, unless the user asked for the bars."""
    key = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    preset = key in os.environ
    if not preset:
        os.environ[key] = "false"
    try:
        with warnings.catch_warnings():
            # The signature says what to send; an example would cost a Spark job per fit.
            warnings.filterwarnings("ignore", message=".*input example was not provided")
            yield
    finally:
        if not preset:
            os.environ.pop(key, None)


def log_model(model: Any, df: Any = None, dataset: Any = None, name: str = "model") -> Any:
    """Log ``model`` to the active MLflow run as a pyfunc model named ``name``.

    Args:
        model: A fitted ``HvdModel``.
        df: The training DataFrame (its feature columns' schema makes the signature).
        dataset: The stored dataset's spec, used when there is no DataFrame.
        name: The logged model's name (``runs:/<run_id>/<name>`` loads it).

    Returns:
        MLflow's ``ModelInfo`` (``model_uri`` loads it).
    """
    with tempfile.TemporaryDirectory(prefix="hvd_spark_mlflow_") as tmp, _quiet():
        path = os.path.join(tmp, ARTIFACT)
        model.write().save(path)
        return mlflow.pyfunc.log_model(
            name=name, python_model=HvdPyfuncModel(), artifacts={ARTIFACT: path},
            signature=signature(model, df, dataset), pip_requirements=requirements(model))
