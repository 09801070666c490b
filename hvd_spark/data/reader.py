"""Worker side: rank-sharded, shuffled, equal-steps numpy batches from Parquet (pyarrow only).

How rows are shared out, per epoch and identically on every rank: the row groups of
all files are put in an order (a permutation seeded by ``(seed, epoch)`` when shuffling),
their rows are laid end to end, and rank ``r`` of ``size`` takes the contiguous range
``[r*N//size, (r+1)*N//size)``. Shares are therefore disjoint, complete and differ by
at most one row; each rank reads only the row groups that overlap its range. Every
rank then runs ``steps_per_epoch = (N // size) // batch_size`` steps, so no rank waits
for another at the end of an epoch; the few rows beyond that are dropped (different
ones each epoch when shuffling). Within a rank, rows pass through a seeded shuffle
buffer. Row groups are decoded by several threads at once (pyarrow releases the GIL)
and a prefetch thread keeps batches ready while the model trains.
"""

from __future__ import annotations

import math
import os
import posixpath
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from pyarrow import fs as pafs

from hvd_spark.data.layout import is_packed, unpack
from hvd_spark.data.prefetch import Prefetcher
from hvd_spark.data.shuffle import Batch, rebatch
from hvd_spark.data.spec import DatasetSpec
from hvd_spark.data.store import filesystem_from_url
from hvd_spark.errors import ConfigError, DataError


class _Piece(NamedTuple):
    """One non-empty row group: the unit of planning and of parallel decoding."""

    path: str
    metadata: pq.FileMetaData
    group: int
    rows: int


class ShardReader:
    """Reads this rank's share of a Parquet dataset as batches of numpy arrays.

    Args:
        source: A ``DatasetSpec`` from the writer, or a list of Parquet file paths/URLs.
        rank: This worker's rank, ``0 <= rank < size``.
        size: Number of workers reading the same data.
        batch_size: Rows per batch (per rank).
        split: ``"train"`` or ``"val"`` when ``source`` is a spec.
        columns: Columns to read; default: all columns of the spec (or of the files).
        filesystem: pyarrow filesystem of ``source`` paths; default: from the path/URL.
        shuffle: Shuffle row-group order and rows (seeded, different each epoch).
        seed: Seed shared by all ranks; the same seed and epoch give the same batches.
        shuffle_buffer_size: Rows mixed in the shuffle buffer (memory: rows x row size).
            Default: 10,000 rows, fewer when rows are wide, so that the buffer stays
            under 256 MiB (224x224x3 float32 images: 445 rows), and never under a batch.
        steps_per_epoch: Batches per epoch; default ``(rows // size) // batch_size``. More
            than that reads the data several times within an epoch.
        num_threads: Row groups decoded at the same time; default ``min(4, CPUs)``:
            decoding is CPU-bound, so threads beyond the cores only contend.
        prefetch_batches: Batches kept ready by the prefetch thread.
        timeout_s: Longest wait for one batch (or one row group) before ``DataError``.
    """

    def __init__(
        self,
        source: DatasetSpec | Sequence[str],
        rank: int,
        size: int,
        batch_size: int,
        *,
        split: str = "train",
        columns: Sequence[str] | None = None,
        filesystem: pafs.FileSystem | None = None,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer_size: int | None = None,
        steps_per_epoch: int | None = None,
        num_threads: int | None = None,
        prefetch_batches: int = 8,
        timeout_s: float = 600.0,
    ) -> None:
        _check_int("size", size, 1)
        _check_int("batch_size", batch_size, 1)
        if num_threads is None:
            num_threads = min(4, os.cpu_count() or 1)
        _check_int("num_threads", num_threads, 1)
        if shuffle_buffer_size is not None:
            _check_int("shuffle_buffer_size", shuffle_buffer_size, 0)
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise ConfigError(f"rank must be an int in [0, size={size}), got {rank!r}")
        if steps_per_epoch is not None:
            _check_int("steps_per_epoch", steps_per_epoch, 1)
        self.rank, self.size, self.batch_size = rank, size, batch_size
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.shuffle_buffer_size = shuffle_buffer_size
        self.num_threads, self.prefetch_batches = num_threads, prefetch_batches
        self.timeout_s = float(timeout_s)
        self._split = split
        self._shapes: dict[str, tuple[int, ...] | None] = {}
        self._dtypes: dict[str, np.dtype] = {}
        self._fs, paths = self._resolve(source, split, filesystem)
        self._dataset = ds.dataset(paths, filesystem=self._fs, format="parquet")
        self._local = isinstance(self._fs, pafs.LocalFileSystem)
        self.columns = list(columns) if columns is not None else self._default_columns()
        self._check_columns()
        self._pieces = self._row_groups()
        self._infer_list_shapes()
        if self.shuffle_buffer_size is None:
            self.shuffle_buffer_size = default_shuffle_buffer(self.row_bytes(), batch_size)
        self.num_rows = int(sum(piece.rows for piece in self._pieces))
        natural = (self.num_rows // size) // batch_size
        if natural == 0 and steps_per_epoch is None:
            raise DataError(
                f"split {split!r} has {self.num_rows} rows, fewer than size x batch_size = "
                f"{size} x {batch_size}: no rank would get a full batch. Use a smaller batch "
                "size or fewer workers, or add data"
            )
        if self.num_rows < size:
            raise DataError(f"split {split!r} has {self.num_rows} rows, fewer than size={size}")
        self.steps_per_epoch = steps_per_epoch or natural

    # Setup ----------------------------------------------------------------------------

    def _resolve(
        self, source: Any, split: str, filesystem: pafs.FileSystem | None
    ) -> tuple[pafs.FileSystem, list[str]]:
        if isinstance(source, DatasetSpec):
            fs, base = filesystem_from_url(source.root_url)
            files = source.split(split).files
            for col in source.columns:
                self._shapes[col.name] = tuple(col.shape)
                self._dtypes[col.name] = np.dtype(col.dtype)
            self._spec_columns = source.column_names
            paths = [posixpath.join(base, f) for f in files]
        elif isinstance(source, (list, tuple)) and source and all(
            isinstance(p, str) for p in source
        ):
            self._spec_columns = None
            if filesystem is not None:
                fs, paths = filesystem, list(source)
            else:
                fs, first = filesystem_from_url(source[0])
                paths = [first] + [filesystem_from_url(p)[1] for p in source[1:]]
        else:
            raise ConfigError(
                f"source must be a DatasetSpec or a non-empty list of Parquet paths, got {source!r}"
            )
        if not paths:
            raise DataError(f"split {split!r} has no files: the dataset holds no rows for it")
        return fs, paths

    def _default_columns(self) -> list[str]:
        return list(self._spec_columns or self._dataset.schema.names)

    def _check_columns(self) -> None:
        schema = self._dataset.schema
        missing = [c for c in self.columns if c not in schema.names]
        if missing:
            raise ConfigError(
                f"column(s) {missing} not in the Parquet files; they have: "
                f"{', '.join(schema.names)}"
            )
        for name in self.columns:
            field_type = schema.field(name).type
            if is_packed(field_type) and name not in self._shapes:
                raise ConfigError(
                    f"column {name!r} holds packed arrays (fixed-size binary) whose dtype and "
                    "shape only the dataset spec knows: read it through its DatasetSpec")
            if is_packed(field_type):
                continue
            value_type = field_type.value_type if _is_list(field_type) else field_type
            self._dtypes.setdefault(name, np.dtype(value_type.to_pandas_dtype()))
            if name not in self._shapes:
                self._shapes[name] = (None,) if _is_list(field_type) else ()

    def _row_groups(self) -> list[_Piece]:
        pieces = []
        for fragment in self._dataset.get_fragments():
            fragment.ensure_complete_metadata()
            pieces.extend(
                _Piece(fragment.path, fragment.metadata, group.id, group.num_rows)
                for group in fragment.row_groups
                if group.num_rows
            )
        return pieces

    def _infer_list_shapes(self) -> None:
        # Plain files carry no shapes: take a list column's length from its first row.
        unknown = [c for c in self.columns if self._shapes[c] == (None,)]
        if unknown and self._pieces:
            table = self._read_table(0, unknown).slice(0, 1)
            for name in unknown:
                self._shapes[name] = (len(table.column(name)[0]),)

    def row_bytes(self) -> int:
        """Bytes of one row of the selected columns, as numpy holds them."""
        return sum(self._dtypes[c].itemsize * math.prod(d or 1 for d in self._shapes[c] or ())
                   for c in self.columns)

    def column_info(self) -> dict[str, tuple[tuple[int | None, ...], np.dtype]]:
        """Per column: (shape of one row's value, numpy dtype); None marks an unknown length."""
        return {c: (tuple(self._shapes[c] or ()), self._dtypes[c]) for c in self.columns}

    # Planning -------------------------------------------------------------------------

    def shard_plan(self, epoch: int) -> list[tuple[int, int, int]]:
        """``(piece, offset, length)`` row ranges this rank reads in ``epoch``, in read order."""
        per_rank = self.num_rows // self.size
        wanted = self.steps_per_epoch * self.batch_size
        passes = max(1, math.ceil(wanted / per_rank))
        rows = np.array([piece.rows for piece in self._pieces], dtype=np.int64)
        plan: list[tuple[int, int, int]] = []
        for p in range(passes):
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch, p]).permutation(len(rows))
            else:
                order = np.arange(len(rows))
            ends = np.cumsum(rows[order])
            lo = self.rank * self.num_rows // self.size
            hi = (self.rank + 1) * self.num_rows // self.size
            for idx, end in zip(order.tolist(), ends.tolist()):
                start = end - int(rows[idx])
                if end <= lo or start >= hi:
                    continue
                offset = max(lo - start, 0)
                plan.append((idx, offset, min(hi, end) - start - offset))
        return plan

    # Reading --------------------------------------------------------------------------

    def epoch(self, epoch: int = 0) -> Prefetcher[Batch]:
        """Iterator over exactly ``steps_per_epoch`` batches of ``epoch``, read ahead in a thread.

        Batches are dicts of numpy arrays (column -> ``(batch_size, *shape)``) and may be
        read-only views: copy before changing them in place.
        """
        _check_int("epoch", epoch, 0)
        return Prefetcher(
            self._batches(epoch),
            self.prefetch_batches,
            self.timeout_s,
            name=f"hvd_spark-reader-rank{self.rank}-epoch{epoch}",
        )

    def __len__(self) -> int:
        return self.steps_per_epoch

    def _batches(self, epoch: int) -> Iterator[Batch]:
        rng = np.random.default_rng([self.seed, epoch, self.rank, 1]) if self.shuffle else None
        parts = self._decoded(self.shard_plan(epoch))
        produced = 0
        for batch in rebatch(parts, self.batch_size, self.shuffle_buffer_size, rng):
            yield batch
            produced += 1
            if produced == self.steps_per_epoch:
                return
        raise DataError(  # cannot happen when the plan covers the steps; guards against bugs
            f"rank {self.rank}: epoch {epoch} produced {produced} of {self.steps_per_epoch} batches"
        )

    def _decoded(self, plan: list[tuple[int, int, int]]) -> Iterator[Batch]:
        executor = ThreadPoolExecutor(self.num_threads, thread_name_prefix="hvd_spark-decode")
        pending: list[Future] = []
        todo = iter(plan)
        try:
            for item in todo:
                pending.append(executor.submit(self._read_piece, *item))
                if len(pending) > self.num_threads:
                    break
            while pending:
                part = pending.pop(0).result(timeout=self.timeout_s)
                nxt = next(todo, None)
                if nxt is not None:
                    pending.append(executor.submit(self._read_piece, *nxt))
                yield part
        finally:
            executor.shutdown(wait=True, cancel_futures=True)

    def _read_piece(self, index: int, offset: int, length: int) -> Batch:
        # Runs in a decode thread: decoding and the (mostly zero-copy) conversion to
        # numpy, with its null and shape checks, happen in parallel.
        table = self._read_table(index, self.columns).slice(offset, length)
        return table_to_numpy(table, self.columns, self._shapes, self._dtypes)

    def _read_table(self, index: int, columns: Sequence[str]) -> pa.Table:
        # ParquetFile.read_row_group with the footer already parsed skips the dataset
        # scanner's per-fragment set-up. Remote files are pre-buffered: one coalesced
        # read instead of one request per column chunk.
        piece = self._pieces[index]
        with self._fs.open_input_file(piece.path) as source:
            parquet = pq.ParquetFile(source, metadata=piece.metadata, pre_buffer=not self._local)
            return parquet.read_row_group(piece.group, columns=list(columns), use_threads=False)


SHUFFLE_BUFFER_ROWS = 10_000
SHUFFLE_BUFFER_BYTES = 256 << 20


def default_shuffle_buffer(row_bytes: int, batch_size: int) -> int:
    """``SHUFFLE_BUFFER_ROWS``, fewer for wide rows (at most ``SHUFFLE_BUFFER_BYTES``),
    but at least one batch."""
    fits = SHUFFLE_BUFFER_BYTES // max(row_bytes, 1)
    return max(batch_size, min(SHUFFLE_BUFFER_ROWS, fits))


def table_to_numpy(
    table: pa.Table, columns: Sequence[str], shapes: dict[str, tuple[int, ...] | None],
    dtypes: dict[str, np.dtype] | None = None,
) -> Batch:
    """Convert ``columns`` of ``table`` to numpy arrays, list columns to ``(rows, *shape)``.

    Packed columns (see ``hvd_spark.data.layout``) need their ``dtypes`` and ``shapes``.
    """
    out: Batch = {}
    rows = table.num_rows
    for name in columns:
        col = table.column(name)
        arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
        if arr.null_count:
            raise DataError(f"column {name!r} has {arr.null_count} null value(s); fill them")
        if is_packed(arr.type):
            shape, dtype = (shapes or {}).get(name), (dtypes or {}).get(name)
            if shape is None or dtype is None or None in shape:
                raise DataError(f"column {name!r} is packed; its dtype and shape are needed")
            out[name] = unpack(arr, name, dtype, tuple(shape))
            continue
        if not _is_list(arr.type):
            out[name] = arr.to_numpy(zero_copy_only=False)
            continue
        values = arr.flatten()
        if values.null_count:
            raise DataError(f"column {name!r} has null elements inside its arrays")
        shape = shapes.get(name)
        if shape is None or None in shape:
            lengths = pc.list_value_length(arr)
            lo, hi = pc.min_max(lengths).values() if rows else (pa.scalar(0), pa.scalar(0))
            if lo.as_py() != hi.as_py():
                raise DataError(f"column {name!r} has arrays of unequal length ({lo} to {hi})")
            shape = (hi.as_py() or 0,)
        if len(values) != rows * math.prod(shape):
            raise DataError(
                f"column {name!r}: expected arrays of shape {shape}, got {len(values)} values "
                f"for {rows} rows (arrays of unequal length?)"
            )
        out[name] = values.to_numpy(zero_copy_only=False).reshape(rows, *shape)
    return out


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
