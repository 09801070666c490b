"""Driver side: what a DataFrame holds for training, checked before any row is written or read.

Both ways into the Estimators' training start here: the Store path (``writer``) writes
what this module selected as Parquet, the direct path hands it to the ranks' tasks. In
this order:

1. Settings and the schema are checked without running a Spark job (missing columns,
   string/struct/map columns, a non-numeric validation column).
2. One aggregation pass counts rows, nulls per column, array lengths, bad validation
   values and validation rows, and fingerprints the content (the sum of a 64-bit hash
   of every row). Any bad input raises ``DataError`` here.

Uses pyspark (imported inside functions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hvd_spark.data.spec import IS_VAL, ColumnSpec
from hvd_spark.errors import ConfigError, DataError

#: The user's validation column, carried along for the checks.
VAL_COL = "__hvd_spark_val_col"
_NUMERIC = {
    "byte": "int8", "short": "int16", "integer": "int32", "long": "int64",
    "float": "float32", "double": "float64", "boolean": "bool",
}


@dataclass(frozen=True)
class Inspection:
    """A checked DataFrame, ready to train on.

    Attributes:
        selected: The feature, label and weight columns (ML Vectors as arrays), then
            ``IS_VAL`` (and ``VAL_COL`` with a validation column).
        columns: Their specs, array shapes included (``IS_VAL`` and ``VAL_COL`` not).
        feature_cols, label_cols: The names, as given.
        sample_weight_col: The weight column, if any.
        rows, val_rows: Rows in all, and those marked for validation.
        fingerprint: Order-independent content hash (the writer's cache key).
    """

    selected: Any
    columns: list[ColumnSpec]
    feature_cols: list[str]
    label_cols: list[str]
    sample_weight_col: str | None
    rows: int
    val_rows: int
    fingerprint: Any

    @property
    def train_rows(self) -> int:
        """Rows not marked for validation."""
        return self.rows - self.val_rows


def inspect_dataframe(
    df: Any,
    *,
    feature_cols: Sequence[str] | str,
    label_cols: Sequence[str] | str = (),
    sample_weight_col: str | None = None,
    validation: float | str | None = None,
    num_proc: int,
    batch_size: int,
    val_batch_size: int | None = None,
    seed: int = 0,
) -> Inspection:
    """Check ``df`` for training on ``num_proc`` ranks: the schema, then one Spark job.

    Args:
        df: A pyspark DataFrame.
        feature_cols: Feature column(s): numbers, arrays of numbers or ML Vectors.
        label_cols: Label column(s), same types as features.
        sample_weight_col: Optional numeric per-row weight column.
        validation: None, a fraction in (0, 1) of rows drawn at random (seeded), or the
            name of a 0/1 or boolean column that marks validation rows.
        num_proc: Number of ranks that will train.
        batch_size: Training batch size per rank (checks there is enough data).
        val_batch_size: Validation batch size per rank; default ``batch_size``.
        seed: Seed of the random validation split.

    Raises:
        ConfigError: A setting cannot work.
        DataError: The DataFrame cannot be used (the message names the column).
    """
    features = _names("feature_cols", feature_cols, required=True)
    labels = _names("label_cols", label_cols, required=False)
    _check_settings(validation, num_proc, batch_size, val_batch_size)
    weight = [sample_weight_col] if sample_weight_col else []
    wanted = features + labels + weight
    duplicates = sorted({c for c in wanted if wanted.count(c) > 1})
    if duplicates:
        raise ConfigError(f"column(s) {duplicates} given more than once in feature/label/weight")
    val_col = validation if isinstance(validation, str) else None
    columns = column_specs(df, wanted, val_col)
    selected, is_val = select_columns(df, columns, validation, seed)
    stats = _aggregate(selected, columns, is_val, val_col)
    _check_stats(stats, columns, validation, num_proc, batch_size, val_batch_size or batch_size)
    return Inspection(selected, [_with_shape(c, stats, i) for i, c in enumerate(columns)],
                      features, labels, sample_weight_col, int(stats["n"]),
                      int(stats["val_rows"] or 0), stats["fingerprint"])


def _names(param: str, value: Sequence[str] | str, required: bool) -> list[str]:
    names = [value] if isinstance(value, str) else list(value or ())
    if required and not names:
        raise ConfigError(f"{param} must name at least one column")
    if not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{param} must be column names (strings), got {value!r}")
    return names


def _check_settings(validation: Any, num_proc: int, batch_size: int,
                    val_batch_size: int | None) -> None:
    for name, value in (("num_proc", num_proc), ("batch_size", batch_size),
                        ("val_batch_size", val_batch_size or 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(validation, bool) or not (
        validation is None or isinstance(validation, str)
        or (isinstance(validation, float) and 0.0 < validation < 1.0)
    ):
        raise ConfigError(
            "validation must be None, a float fraction in (0, 1) or the name of a 0/1 or "
            f"boolean column, got {validation!r}"
        )


def column_specs(df: Any, wanted: list[str], val_col: str | None) -> list[ColumnSpec]:
    """Schema-only checks (no Spark job): presence and types of every column."""
    from pyspark.ml.linalg import VectorUDT

    fields = {f.name: f for f in df.schema.fields}
    for name in wanted + ([val_col] if val_col else []):
        if name not in fields:
            raise DataError(
                f"column {name!r} not found in the DataFrame; available columns: "
                f"{', '.join(fields) or '(none)'}"
            )
    if val_col is not None and fields[val_col].dataType.typeName() not in _NUMERIC:
        raise DataError(
            f"validation column {val_col!r} has type {fields[val_col].dataType.simpleString()}; "
            "it must be boolean or a number that is 0 (train) or 1 (validation)"
        )
    specs = []
    for name in wanted:
        dtype = fields[name].dataType
        if isinstance(dtype, VectorUDT):
            specs.append(ColumnSpec(name, "float32", (), "vector"))
        elif dtype.typeName() in _NUMERIC:
            specs.append(ColumnSpec(name, _NUMERIC[dtype.typeName()], (), "scalar"))
        elif dtype.typeName() == "array" and dtype.elementType.typeName() in _NUMERIC:
            specs.append(ColumnSpec(name, _NUMERIC[dtype.elementType.typeName()], (), "array"))
        else:
            raise DataError(
                f"column {name!r} has type {dtype.simpleString()}; feature, label and weight "
                "columns must be numbers, arrays of numbers or ML Vectors. Convert it first "
                "(e.g. StringIndexer for strings, cast decimals to double, flatten structs)"
            )
    return specs


def select_columns(df: Any, columns: list[ColumnSpec], validation: Any,
                   seed: int) -> tuple[Any, Any]:
    """Return (DataFrame of the stored columns + IS_VAL, the IS_VAL expression)."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    exprs = [
        vector_to_array(F.col(c.name), "float32").alias(c.name) if c.kind == "vector"
        else F.col(c.name)
        for c in columns
    ]
    if validation is None:
        is_val = F.lit(False)
    elif isinstance(validation, str):
        is_val = F.col(validation).cast("double") == 1.0
        exprs.append(F.col(validation).alias(VAL_COL))
    else:
        is_val = F.rand(seed) < validation
    return df.select(*exprs, is_val.alias(IS_VAL)), is_val


def _aggregate(df: Any, columns: list[ColumnSpec], is_val: Any, val_col: str | None) -> dict:
    """One Spark job: counts, nulls, array lengths, bad validation values, fingerprint."""
    from pyspark.sql import functions as F

    def count_if(cond: Any) -> Any:
        return F.sum(F.when(cond, 1).otherwise(0))

    aggs = [F.count(F.lit(1)).alias("n"), count_if(F.col(IS_VAL)).alias("val_rows")]
    hashed = [F.col(c.name) for c in columns]
    for i, c in enumerate(columns):
        col = F.col(c.name)
        aggs.append(count_if(col.isNull()).alias(f"null_{i}"))
        if c.kind != "scalar":
            aggs += [F.min(F.size(col)).alias(f"min_{i}"), F.max(F.size(col)).alias(f"max_{i}"),
                     count_if(F.exists(col, lambda x: x.isNull())).alias(f"nullel_{i}")]
        if c.dtype.startswith("float"):
            # NaN/inf would train silently to a NaN model: count the rows holding any.
            bad = (F.exists(col, _non_finite) if c.kind != "scalar" else _non_finite(col))
            aggs.append(count_if(bad).alias(f"nonfinite_{i}"))
    if val_col is not None:
        val = F.col(VAL_COL)
        bad = val.isNull() | ~val.cast("double").isin(0.0, 1.0)
        aggs += [count_if(bad).alias("val_bad"),
                 F.min(F.when(bad, val.cast("double"))).alias("val_bad_min"),
                 F.max(F.when(bad, val.cast("double"))).alias("val_bad_max")]
        hashed.append(val)
    # Order-independent content fingerprint; decimal avoids overflow of a long sum.
    aggs.append(F.sum(F.xxhash64(*hashed).cast("decimal(38,0)")).alias("fingerprint"))
    return df.agg(*aggs).collect()[0].asDict()


def _non_finite(x: Any) -> Any:
    from pyspark.sql import functions as F

    return F.isnan(x) | (F.abs(x) == F.lit(float("inf")))


def _check_stats(stats: dict, columns: list[ColumnSpec], validation: Any, num_proc: int,
                 batch_size: int, val_batch_size: int) -> None:
    n = stats["n"]
    if n == 0:
        raise DataError("the DataFrame is empty: there is nothing to train on")
    nulls = {c.name: stats[f"null_{i}"] for i, c in enumerate(columns) if stats[f"null_{i}"]}
    if nulls:
        listed = ", ".join(f"{k!r} ({v} rows)" for k, v in nulls.items())
        raise DataError(f"null values in column(s) {listed}; drop or fill them (df.na.drop/fill)")
    for i, c in enumerate(columns):
        if c.kind == "scalar":
            continue
        if stats[f"nullel_{i}"]:
            raise DataError(f"column {c.name!r} has null elements inside {stats[f'nullel_{i}']} "
                            "array(s); fill them first")
        lo, hi = stats[f"min_{i}"], stats[f"max_{i}"]
        if lo != hi:
            raise DataError(f"column {c.name!r} has arrays of unequal length ({lo} to {hi}); "
                            "every row must have the same length (pad or truncate them)")
        if lo == 0:
            raise DataError(f"column {c.name!r} holds empty arrays")
    bad = {c.name: stats[f"nonfinite_{i}"] for i, c in enumerate(columns)
           if stats.get(f"nonfinite_{i}")}
    if bad:
        listed = ", ".join(f"{k!r} ({v} rows)" for k, v in bad.items())
        raise DataError(f"NaN or infinite values in column(s) {listed}; drop or replace those "
                        "rows (e.g. df.replace(float('nan'), 0.0) or a filter on isnan) first")
    if stats.get("val_bad"):
        raise DataError(
            f"validation column {validation!r} has {stats['val_bad']} row(s) that are not 0/1 "
            f"(null, or values from {stats['val_bad_min']} to {stats['val_bad_max']}); "
            "use 1 (or true) for validation rows and 0 (or false) for training rows"
        )
    val_rows = stats["val_rows"] or 0
    train_rows = n - val_rows
    if train_rows < num_proc * batch_size:
        raise DataError(
            f"{train_rows} training rows are fewer than num_proc x batch_size = {num_proc} x "
            f"{batch_size}: not one full batch per process. Use a smaller batch_size or "
            "num_proc, a smaller validation share, or more data"
        )
    if validation is not None and val_rows < num_proc * val_batch_size:
        raise DataError(
            f"{val_rows} validation rows are fewer than num_proc x val_batch_size = {num_proc} "
            f"x {val_batch_size}. Use a larger validation share or a smaller val_batch_size"
        )


def _with_shape(c: ColumnSpec, stats: dict, i: int) -> ColumnSpec:
    if c.kind == "scalar":
        return c
    return ColumnSpec(c.name, c.dtype, (int(stats[f"min_{i}"]),), c.kind)
