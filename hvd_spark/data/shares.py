"""The driver's side of ``run(fn, df=...)``: the DataFrame as one share per rank, no Store.

``prepare_shares`` checks the columns (schema only, no Spark job: the rules of
``make_converter``), turns ML Vectors into arrays, and repartitions the rows round-robin
into ``num_proc`` partitions: the barrier stage's task ``i`` reads partition ``i`` straight
from Spark's shuffle and writes it to its executor's local disk for its rank
(``rank_share.write_share``). Nothing is written to a Store or a shared filesystem.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from hvd_spark.data.inspection import column_specs
from hvd_spark.errors import ConfigError, DataError


def prepare_shares(df: Any, num_proc: int, columns: Sequence[str] | None = None) -> Any:
    """``df``'s columns as a DataFrame of ``num_proc`` partitions, one per rank.

    Args:
        df: A pyspark DataFrame of numbers, arrays of numbers and ML Vectors.
        num_proc: Number of ranks.
        columns: Columns to keep; default all.

    Raises:
        ConfigError: ``df`` is not a DataFrame.
        DataError: A column is missing or has a type no model can take (naming it), or
            ``df`` has fewer rows than ranks.
    """
    if not hasattr(df, "schema") or not hasattr(df, "repartition"):
        raise ConfigError(f"df must be a pyspark DataFrame, got {type(df).__name__}")
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    wanted = list(columns) if columns is not None else [f.name for f in df.schema.fields]
    specs = column_specs(df, wanted, None)
    rows = df.limit(num_proc).count()  # a small job: it stops at num_proc rows
    if rows < num_proc:
        raise DataError(empty_share_message({0: rows}, num_proc))
    exprs = [vector_to_array(F.col(c.name), "float32").alias(c.name) if c.kind == "vector"
             else F.col(c.name) for c in specs]
    return df.select(*exprs).repartition(num_proc)


def empty_share_message(rows: dict[int, int], num_proc: int) -> str:
    """What to say when some rank's share has no rows (``rows``: partition -> rows)."""
    total = sum(rows.values())
    empty = sorted(p for p, n in rows.items() if n == 0)
    if total < num_proc:
        return (f"the DataFrame has {total} rows, fewer than the {num_proc} ranks: every rank "
                "needs rows to train on; use fewer ranks (num_proc) or more data")
    return (f"the shares of partitions {empty} are empty after repartitioning {total} rows "
            f"into {num_proc}: use fewer ranks, or more rows")


def write_local_shares(df: Any, num_proc: int, directory: str) -> list[tuple[str, int]]:
    """Write ``df``'s rows as ``num_proc`` share files in ``directory``, for local ranks.

    One Spark job (not a barrier stage): task ``i`` streams partition ``i`` of
    :func:`prepare_shares` into ``directory/share-i.arrow``. The executors must see the
    driver's ``directory``: a local master.

    Returns:
        ``(path, rows)`` of each share, index = rank.

    Raises:
        DataError: As :func:`prepare_shares`, or a share came out empty.
    """
    frame = prepare_shares(df, num_proc)

    def write(batches: Any) -> Any:
        import os

        import pyarrow as pa
        from pyspark import TaskContext

        from hvd_spark.data.rank_share import write_share

        part = TaskContext.get().partitionId()
        path = os.path.join(directory, f"share-{part}.arrow")
        rows = write_share(batches, path)
        yield pa.RecordBatch.from_pydict({"partition": [part], "rows": [rows]})

    got = {row["partition"]: row["rows"] for row in
           frame.mapInArrow(write, "partition long, rows long").collect()}
    rows = {p: got.get(p, 0) for p in range(num_proc)}
    if min(rows.values()) == 0:
        raise DataError(empty_share_message(rows, num_proc))
    return [(os.path.join(directory, f"share-{p}.arrow"), rows[p]) for p in range(num_proc)]
