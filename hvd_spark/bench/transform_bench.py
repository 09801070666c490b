"""Model.transform throughput: the Arrow UDF path vs the earlier row-stacking pandas path.

``python -m hvd_spark.bench transform [--rows 200000 --features 784 ...]`` runs a small
torch MLP (features -> 64 -> 10, what an MNIST model looks like) over a DataFrame of
``rows`` rows holding one ``array<double>`` feature column (``--vector``: a Spark ML
Vector), through both prediction paths of ``hvd_spark.estimator.transform``:

- pandas: ``predict_columns_pandas``, a pandas UDF that stacks each batch's rows one by one;
- arrow: ``predict_columns``, an Arrow UDF that reads each batch's flat value buffer;
- Spark predict_batch_udf: ``pyspark.ml.functions.predict_batch_udf`` on the same model,
  which hands the model ``np.vstack`` of a pandas Series holding one array per row;
- no model: the features alone, computed and written with no Python at all (the floor).

The features are computed in the JVM from the row id on every run (so nothing is cached
and the driver needs no memory for them), and each run writes the predictions to Spark's
``noop`` sink, so every row is computed and predicted. The paths alternate for
``--repeat`` rounds, so both see the same machine load; medians and bests are printed in
rows/s. Both paths' predictions are compared on a sample first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import cloudpickle


def _frame(spark, rows: int, features: int, vector: bool):
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    # Pixel-like values in [0, 1], different for every row and feature.
    pixels = F.transform(F.sequence(F.lit(0), F.lit(features - 1)),
                         lambda i: ((F.col("id") * 31 + i * 17) % 256) / 255.0)
    df = spark.range(rows).withColumn("features", pixels)
    return df.withColumn("features", array_to_vector("features")) if vector else df


def _model_bytes(features: int) -> bytes:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    return cloudpickle.dumps({"model": model, "input_shapes": [[-1, features]]})


def _spark_predict_batch_udf(df, feature_cols, output_cols, output_shapes, model_bytes,
                             factory, batch_size):
    """Spark's own ``predict_batch_udf`` on the same model, for comparison (one output)."""
    from pyspark.ml.functions import predict_batch_udf, vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from hvd_spark.estimator.transform import cached_predictor

    (col,), (out,) = feature_cols, output_cols
    row_shape = list(cloudpickle.loads(model_bytes)["input_shapes"][0][1:])  # torch_predictor's
    features = df.schema[col].dataType
    value = vector_to_array(F.col(col)) if isinstance(features, VectorUDT) else F.col(col)

    def make_predict_fn():
        predict = cached_predictor(model_bytes, factory)
        return lambda x: predict([x.astype("float32")])[0].astype("float64")

    udf = predict_batch_udf(make_predict_fn, return_type=T.ArrayType(T.DoubleType()),
                            batch_size=batch_size, input_tensor_shapes=[row_shape])
    return df.withColumn(out, udf(value))


def _features_only(df, *_args):
    """The floor: the same features computed and written, no Python and no model."""
    return df


def _time(predict, df, args) -> float:
    start = time.perf_counter()
    predict(df, *args).write.format("noop").mode("overwrite").save()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table."""
    parser = argparse.ArgumentParser(prog="python -m hvd_spark.bench transform",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--features", type=int, default=784)
    parser.add_argument("--batch-size", type=int, default=256, help="rows per model call")
    parser.add_argument("--repeat", type=int, default=3, help="alternating rounds")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--vector", action="store_true", help="a Vector feature column")
    args = parser.parse_args(argv)

    from pyspark.sql import SparkSession

    from hvd_spark.estimator import transform

    # Spark's Python workers run this interpreter (with torch and pyarrow), on loopback.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from hvd_spark.estimator.torch_worker import torch_predictor

    spark = (SparkSession.builder.master(args.master).appName("hvd_spark transform bench")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    try:
        df = _frame(spark, args.rows, args.features, args.vector)
        call = (["features"], ["label__output"], [(10,)], _model_bytes(args.features),
                torch_predictor, args.batch_size)
        sample = df.limit(2000)
        old = sorted(transform.predict_columns_pandas(sample, *call)
                     .select("id", "label__output").collect())
        new = sorted(transform.predict_columns(sample, *call)
                     .select("id", "label__output").collect())
        spark_udf = sorted(_spark_predict_batch_udf(sample, *call)
                           .select("id", "label__output").collect())
        identical = old == new
        print(f"Spark's predict_batch_udf gives the same predictions: {old == spark_udf}")
        paths = {"pandas (rows stacked)": transform.predict_columns_pandas,
                 "arrow (flat buffers)": transform.predict_columns,
                 "Spark predict_batch_udf": _spark_predict_batch_udf,
                 "no model (JVM only)": _features_only}
        for predict in paths.values():  # start the Python workers, load torch in them
            _time(predict, df.limit(5000), call)
        seconds: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.repeat):
            for name, predict in paths.items():
                seconds[name].append(_time(predict, df, call))
        kind = "Vector" if args.vector else "array<double>"
        print(f"transform: {args.rows} rows x {args.features} features ({kind}), MLP "
              f"{args.features}-64-10, batch_size {args.batch_size}, {args.master}, "
              f"{args.repeat} alternating rounds; predictions identical on 2000 rows: "
              f"{identical}")
        print(f"{'path':24s} {'median rows/s':>14s} {'best rows/s':>12s} {'median s':>9s}")
        medians = {}
        for name, times in seconds.items():
            medians[name] = statistics.median(times)
            print(f"{name:24s} {args.rows / medians[name]:14,.0f} "
                  f"{args.rows / min(times):12,.0f} {medians[name]:9.2f}")
        old_s, new_s, _, jvm_s = medians.values()
        print(f"speed-up (median): {old_s / new_s:.2f}x; beyond computing the features in "
              f"the JVM: {(old_s - jvm_s) / max(new_s - jvm_s, 1e-9):.2f}x")
        return 0 if identical else 1
    finally:
        spark.stop()


if __name__ == "__main__":
    raise SystemExit(main())
