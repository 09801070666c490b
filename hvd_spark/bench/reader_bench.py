"""Parquet reader throughput: ``ShardReader`` (shuffled) vs a plain single-threaded scan.

``python -m hvd_spark.bench reader [--rows 1000000 --cols 100 ...]`` writes ``rows x
cols`` float32 values as Parquet files with pyarrow in a temporary directory (no Spark),
in the layout ``write_dataset`` writes (required columns, no dictionary for floating
point; ``--pyarrow-defaults`` keeps pyarrow's: nullable, dictionary-encoded), then times,
on the same files:

- plain: ``pyarrow.dataset`` ``to_batches(use_threads=False)``, each batch turned into
  numpy arrays, one per column (what a training loop is handed);
- hvd_spark: ``ShardReader(rank=0, size=1, shuffle=True)``, whose batches already are one
  numpy array per column.

``--vector`` stores the values as one array column (a Vector feature, packed by
``write_dataset`` as fixed-size binary; a list column with ``--pyarrow-defaults``); both
sides then hand out one ``(batch, cols)`` array per batch.

``--matrix`` also stacks every batch's columns into one 2-D float32 array on both sides:
the same extra consumer work for each, which dilutes the ratio (it runs in the consumer's
thread and takes about as long as the decoding).

The two alternate for ``--repeat`` rounds (the files stay in the page cache), so both see
the same machine load; the best and the median of each are printed, and the ratios
compare like with like.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from hvd_spark.data.layout import (
    dictionary_columns,
    is_packed,
    pack_arrays,
    storage_schema,
    unpack,
)
from hvd_spark.data.reader import ShardReader
from hvd_spark.data.spec import ColumnSpec, DatasetSpec, SplitSpec


def write_files(directory: str, rows: int, cols: int, files: int, row_group: int,
                pyarrow_defaults: bool = False, vector: bool = False) -> list[str]:
    """Write ``rows x cols`` random float32 values as ``files`` Parquet files; return paths.

    One column per value, or with ``vector`` one array column ``x`` of ``cols`` values.
    """
    rng = np.random.default_rng(0)
    names = [f"f{i:03d}" for i in range(cols)]
    paths = []
    per_file = -(-rows // files)
    for i, start in enumerate(range(0, rows, per_file)):
        n = min(per_file, rows - start)
        data = rng.random((cols, n), dtype=np.float32)
        if vector:
            values = pa.array(np.ascontiguousarray(data.T).reshape(-1))
            table = pa.table({"x": pa.ListArray.from_arrays(
                pa.array(np.arange(0, (n + 1) * cols, cols, dtype=np.int32)), values)})
        else:
            table = pa.table(dict(zip(names, data)))
        path = os.path.join(directory, f"part-{i:05d}.parquet")
        options = {}
        if not pyarrow_defaults:  # the layout write_dataset writes
            table = pack_arrays(table, _specs(cols, vector))
            table = table.cast(storage_schema(table.schema))
            options["use_dictionary"] = dictionary_columns(table.schema)
        pq.write_table(table, path, row_group_size=row_group, **options)
        paths.append(path)
    return paths


def _specs(cols: int, vector: bool) -> tuple[ColumnSpec, ...]:
    if vector:
        return (ColumnSpec("x", "float32", (cols,), "array"),)
    return tuple(ColumnSpec(f"f{i:03d}", "float32") for i in range(cols))


def _spec(paths: list[str], cols: int, vector: bool) -> DatasetSpec:
    specs = _specs(cols, vector)
    return DatasetSpec(
        key="bench", root_url=os.path.dirname(paths[0]), columns=specs,
        feature_cols=tuple(c.name for c in specs),
        train=SplitSpec(tuple(os.path.basename(p) for p in paths)))


def plain_scan(paths: list[str], cols: int, batch_size: int, matrix: bool,
               vector: bool = False) -> int:
    """Single-threaded pyarrow.dataset scan to numpy batches; returns rows read."""
    rows = 0
    dataset = ds.dataset(paths, format="parquet")
    for rb in dataset.to_batches(batch_size=batch_size, use_threads=False):
        if vector:
            column = rb.column(0)
            if is_packed(column.type):
                arrays = unpack(column, "x", np.dtype(np.float32), (cols,))
            else:
                arrays = column.flatten().to_numpy().reshape(rb.num_rows, cols)
        else:
            arrays = [rb.column(i).to_numpy() for i in range(rb.num_columns)]
            if matrix:
                arrays = np.stack(arrays, axis=1)
        rows += rb.num_rows
    return rows


def reader_scan(paths: list[str], cols: int, batch_size: int, threads: int | None,
                matrix: bool, vector: bool = False) -> int:
    """ShardReader with shuffle to numpy batches; returns rows read."""
    reader = ShardReader(_spec(paths, cols, vector), 0, 1, batch_size, shuffle=True,
                         num_threads=threads)
    names = [c.name for c in _specs(cols, vector)]
    rows = 0
    for batch in reader.epoch(0):
        if matrix and not vector:
            np.stack([batch[c] for c in names], axis=1)
        rows += len(batch[names[0]])
    return rows


def _alternate(fns: list, repeat: int) -> list[tuple[list[float], int]]:
    """Run each of ``fns`` once per round, ``repeat`` rounds; per fn: (sorted times, rows)."""
    times: list[list[float]] = [[] for _ in fns]
    rows = [0] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            rows[i] = fn()
            times[i].append(time.perf_counter() - start)
    return [(sorted(t), r) for t, r in zip(times, rows)]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table."""
    parser = argparse.ArgumentParser(prog="python -m hvd_spark.bench reader")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--cols", type=int, default=100)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--row-group", type=int, default=32_768)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None,
                        help="decode threads; default: the reader's, min(4, CPUs)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--matrix", action="store_true",
                        help="also stack each batch into one 2-D array (both sides)")
    parser.add_argument("--pyarrow-defaults", action="store_true",
                        help="write the files with pyarrow's default encodings")
    parser.add_argument("--vector", action="store_true",
                        help="one array column of --cols float32 per row (as a Vector "
                             "feature), instead of --cols scalar columns")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hvd_spark-reader-bench-") as tmp:
        paths = write_files(tmp, args.rows, args.cols, args.files, args.row_group,
                            args.pyarrow_defaults, args.vector)
        (plain_t, plain_rows), (ours_t, ours_rows) = _alternate([
            lambda: plain_scan(paths, args.cols, args.batch_size, args.matrix, args.vector),
            lambda: reader_scan(paths, args.cols, args.batch_size, args.threads, args.matrix,
                                args.vector),
        ], args.repeat)
    threads = args.threads or min(4, os.cpu_count() or 1)
    print(
        f"{args.rows} rows x {args.cols} float32 "
        f"{'values in one array column' if args.vector else 'cols'}, {args.files} files, "
        f"row groups of "
        f"{args.row_group}, {'pyarrow default' if args.pyarrow_defaults else 'write_dataset'} "
        f"encodings, batch {args.batch_size}, {os.cpu_count()} CPUs, {args.repeat} alternating "
        f"rounds, batches as "
        f"{'one 2-D array' if args.matrix or args.vector else 'one numpy array per column'}"
    )
    print(f"{'reader':32s} {'rows':>9s} {'best s':>7s} {'median s':>9s} {'M rows/s':>9s} "
          f"{'ratio best':>10s} {'ratio median':>12s}")
    mid = args.repeat // 2
    for label, t, rows in (("plain pyarrow.dataset (1 thread)", plain_t, plain_rows),
                           (f"ShardReader shuffle ({threads} thr)", ours_t, ours_rows)):
        best_ratio = (plain_t[0] / plain_rows) / (t[0] / rows)
        median_ratio = (plain_t[mid] / plain_rows) / (t[mid] / rows)
        print(f"{label:32s} {rows:9d} {t[0]:7.3f} {t[mid]:9.3f} {rows / t[0] / 1e6:9.3f} "
              f"{best_ratio:10.2f} {median_ratio:12.2f}")
    return 0
