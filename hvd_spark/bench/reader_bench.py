"""Parquet reader throughput: ``ShardReader`` (shuffled) vs a plain single-threaded scan.

``python -m hvd_spark.bench reader [--rows 1000000 --cols 100 ...]`` writes ``rows x
cols`` float32 values as Parquet files with pyarrow in a temporary directory (no Spark),
then times, on the same files:

- plain: ``pyarrow.dataset`` ``to_batches(use_threads=False)``, each batch turned into
  numpy arrays, one per column (what a training loop is handed);
- hvd_spark: ``ShardReader(rank=0, size=1, shuffle=True)``, whose batches already are one
  numpy array per column.

``--matrix`` also stacks every batch's columns into one 2-D float32 array on both sides:
the same extra consumer work for each, which dilutes the ratio (it runs in the consumer's
thread and takes about as long as the decoding).

Each is run ``--repeat`` times (the files stay in the page cache) and the best is kept.
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

from hvd_spark.data.reader import ShardReader


def write_files(directory: str, rows: int, cols: int, files: int, row_group: int) -> list[str]:
    """Write ``rows x cols`` random float32 values as ``files`` Parquet files; return paths."""
    rng = np.random.default_rng(0)
    names = [f"f{i:03d}" for i in range(cols)]
    paths = []
    per_file = -(-rows // files)
    for i, start in enumerate(range(0, rows, per_file)):
        n = min(per_file, rows - start)
        data = rng.random((cols, n), dtype=np.float32)
        table = pa.table(dict(zip(names, data)))
        path = os.path.join(directory, f"part-{i:05d}.parquet")
        pq.write_table(table, path, row_group_size=row_group)
        paths.append(path)
    return paths


def plain_scan(paths: list[str], cols: list[str], batch_size: int, matrix: bool) -> int:
    """Single-threaded pyarrow.dataset scan to numpy batches; returns rows read."""
    rows = 0
    dataset = ds.dataset(paths, format="parquet")
    for rb in dataset.to_batches(columns=cols, batch_size=batch_size, use_threads=False):
        arrays = [rb.column(i).to_numpy() for i in range(rb.num_columns)]
        if matrix:
            arrays = np.stack(arrays, axis=1)
        rows += rb.num_rows
    return rows


def reader_scan(paths: list[str], cols: list[str], batch_size: int, threads: int,
                matrix: bool) -> int:
    """ShardReader with shuffle to numpy batches; returns rows read."""
    reader = ShardReader(paths, 0, 1, batch_size, columns=cols, shuffle=True, num_threads=threads)
    rows = 0
    for batch in reader.epoch(0):
        if matrix:
            np.stack([batch[c] for c in cols], axis=1)
        rows += len(batch[cols[0]])
    return rows


def _best(fn, repeat: int) -> tuple[float, int]:
    best, rows = float("inf"), 0
    for _ in range(repeat):
        start = time.perf_counter()
        rows = fn()
        best = min(best, time.perf_counter() - start)
    return best, rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table."""
    parser = argparse.ArgumentParser(prog="python -m hvd_spark.bench reader")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--cols", type=int, default=100)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--row-group", type=int, default=32_768)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=4,
                        help="decode threads (the reader's default)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--matrix", action="store_true",
                        help="also stack each batch into one 2-D array (both sides)")
    args = parser.parse_args(argv)
    cols = [f"f{i:03d}" for i in range(args.cols)]
    with tempfile.TemporaryDirectory(prefix="hvd_spark-reader-bench-") as tmp:
        paths = write_files(tmp, args.rows, args.cols, args.files, args.row_group)
        plain_s, plain_rows = _best(
            lambda: plain_scan(paths, cols, args.batch_size, args.matrix), args.repeat)
        ours_s, ours_rows = _best(
            lambda: reader_scan(paths, cols, args.batch_size, args.threads, args.matrix),
            args.repeat)
    plain_rate, ours_rate = plain_rows / plain_s, ours_rows / ours_s
    print(
        f"{args.rows} rows x {args.cols} float32 cols, {args.files} files, row groups of "
        f"{args.row_group}, batch {args.batch_size}, {os.cpu_count()} CPUs, best of {args.repeat}, "
        f"batches as {'one 2-D array' if args.matrix else 'one numpy array per column'}"
    )
    print(f"{'reader':32s} {'rows':>9s} {'seconds':>8s} {'M rows/s':>9s} {'ratio':>6s}")
    print(f"{'plain pyarrow.dataset (1 thread)':32s} {plain_rows:9d} {plain_s:8.3f} "
          f"{plain_rate / 1e6:9.3f} {1.0:6.2f}")
    print(f"{f'ShardReader shuffle ({args.threads} thr)':32s} {ours_rows:9d} {ours_s:8.3f} "
          f"{ours_rate / 1e6:9.3f} {ours_rate / plain_rate:6.2f}")
    return 0
