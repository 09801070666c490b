"""This rank's share of a DataFrame handed to ``run(fn, df=...)``: no Store, no shared filesystem.

The rank's Spark task writes the rows Spark gives it to an Arrow IPC file on the executor's
local disk (``write_share``) while the rank starts (imports, joins the ring, builds its
model); the rank waits for the shares only when it first reads (``RankShare.current``),
then memory-maps its file and reads shuffled batches from it, epoch after epoch.
Memory: the file's pages are mapped, not loaded (the kernel pages them in and drops them
as it needs); what a rank holds is one epoch's row order (8 bytes a row) and the batch
being built, so a share larger than memory trains. Columns follow ``make_converter``'s
rules: integers as int64, floats as ``float_dtype`` (float32 by default), arrays and ML
Vectors (arrays by then) as 2-D arrays.

Equal steps on every rank: each epoch has ``min_rows // batch_size`` batches, where
``min_rows`` is the smallest share of any rank (the launcher tells each rank: in its
environment, or on a Spark run through its store once every share is written), so ranks
that run a collective per batch never wait for one that ran out; each epoch drops
different rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hvd_spark import _env
from hvd_spark.data.converter_loaders import target_dtype
from hvd_spark.errors import ConfigError


class RankShare:
    """The rows of the job's DataFrame that this rank trains on.

    Args:
        path: The share's Arrow IPC file.
        min_rows: The smallest share of any rank (equal steps per rank).
        rank: This rank (part of each epoch's shuffle seed).

    Raises:
        ConfigError: The file does not exist (not inside ``run(fn, df=...)``).
    """

    def __init__(self, path: str, min_rows: int, rank: int = 0) -> None:
        import pyarrow as pa

        try:
            source = pa.memory_map(path)
        except FileNotFoundError:
            raise ConfigError(f"this rank's share of the DataFrame ({path}) is gone: the "
                              "task that wrote it ended; read it inside fn only") from None
        self.table = pa.ipc.open_file(source).read_all()  # mapped, not copied
        self.min_rows = int(min_rows)
        self.rank = rank
        self._views: dict[str, tuple[np.ndarray, list[np.ndarray]]] | None = None

    @classmethod
    def current(cls) -> RankShare:
        """This rank's share, as its launcher described it.

        Raises:
            ConfigError: The rank was not started with a DataFrame (``run(fn, df=...)``).
        """
        path = _env.get_str(_env.SHARE_PATH)
        if not path:
            raise ConfigError(
                "this rank has no DataFrame share: pass the DataFrame to the launcher, "
                "hvd_spark.run(fn, df=df) (or TorchDistributor.train_on_dataframe(fn, df)), "
                "and read it inside fn")
        return cls(path, _min_rows(), _env.get_int(_env.RANK, 0) or 0)

    @property
    def num_rows(self) -> int:
        """Rows in this rank's share."""
        return self.table.num_rows

    @property
    def columns(self) -> list[str]:
        """The DataFrame's columns."""
        return list(self.table.column_names)

    def steps_per_epoch(self, batch_size: int) -> int:
        """Batches per epoch of ``batch_size`` rows, the same on every rank.

        Raises:
            ConfigError: ``batch_size`` not a positive int, or larger than the smallest
                share (no rank could take a full batch).
        """
        _check_batch_size(batch_size)
        if batch_size > self.min_rows:
            raise ConfigError(
                f"batch_size={batch_size} is larger than the smallest rank's share "
                f"({self.min_rows} rows): no rank could take a full batch; lower it, or "
                "train on fewer ranks")
        return self.min_rows // batch_size

    def epoch(self, epoch: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
              float_dtype: Any = np.float32) -> Iterator[dict[str, np.ndarray]]:
        """The batches of one epoch as dicts ``column -> numpy array``.

        Args:
            epoch: Which epoch (a different order each epoch when shuffling).
            batch_size: Rows per batch.
            shuffle: Shuffle the rows (seeded by ``seed``, ``epoch`` and the rank).
            seed: The shuffle's seed.
            float_dtype: dtype of floating-point columns; None keeps them as written.

        Raises:
            ConfigError: ``batch_size`` not a positive int, or larger than the smallest share.
        """
        used = self.steps_per_epoch(batch_size) * batch_size
        if shuffle:
            rng = np.random.default_rng([seed, epoch, self.rank])
            order = rng.permutation(self.num_rows)[:used]
        else:
            order = np.arange(used)
        for start in range(0, used, batch_size):
            yield self.take(order[start:start + batch_size], float_dtype=float_dtype)

    def take(self, rows: np.ndarray, columns: list[str] | None = None,
             float_dtype: Any = np.float32) -> dict[str, np.ndarray]:
        """The ``rows`` (indices into this share) of ``columns`` (default all), in that order.

        Args:
            rows: Row indices.
            columns: Which columns.
            float_dtype: dtype of floating-point columns; None keeps them as written.
        """
        dtype = None if float_dtype is None else np.dtype(float_dtype)
        views = self._chunk_views()
        return {name: _gather(*views[name], rows, dtype) for name in (columns or self.columns)}

    def _chunk_views(self) -> dict[str, tuple[np.ndarray, list[np.ndarray]]]:
        """Each column as numpy views of its record batches (zero-copy from the mapped file
        where Arrow allows), with each batch's first row: a batch is then gathered with
        numpy's indexing, a copy of its rows only (Arrow's ``take`` on a chunked, mapped
        table was 7x slower than the Store path at 1M rows x 100 floats)."""
        if self._views is None:
            self._views = {}
            for name in self.columns:
                chunks = self.table.column(name).chunks
                sizes = [len(c) for c in chunks]
                starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
                self._views[name] = (starts, [_to_numpy(c, None) for c in chunks])
        return self._views


def _check_batch_size(batch_size: Any) -> None:
    if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) \
            or batch_size < 1:
        raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")


def _gather(starts: np.ndarray, views: list[np.ndarray], rows: np.ndarray,
            float_dtype: np.dtype | None) -> np.ndarray:
    """The ``rows`` (indices into the whole share) of one column, in that order."""
    chunk = np.searchsorted(starts, rows, side="right") - 1
    local = rows - starts[chunk]
    first = next((v for v in views if len(v)), views[0])  # an empty batch has no width
    out = np.empty((len(rows), *first.shape[1:]), dtype=first.dtype)
    for c in np.unique(chunk):
        hit = chunk == c
        out[hit] = views[c][local[hit]]
    return out.astype(target_dtype(out.dtype, float_dtype), copy=False)


def _to_numpy(column: Any, float_dtype: np.dtype | None) -> np.ndarray:
    """One column of a batch as numpy: scalars 1-D, arrays (equal lengths) 2-D."""
    import pyarrow as pa

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type) \
            or pa.types.is_fixed_size_list(array.type):
        values = array.flatten().to_numpy(zero_copy_only=False)
        out = values.reshape(len(array), -1) if len(array) else values.reshape(0, 0)
    else:
        out = array.to_numpy(zero_copy_only=False)
    return out.astype(target_dtype(out.dtype, float_dtype), copy=False)


#: Where a rank started without ``SHARE_MIN_ROWS`` learns it: its worker sets this to ask
#: the launcher (a Spark run's tasks write their shares while the ranks start).
_min_rows_source: Callable[[], int] | None = None


def set_min_rows_source(source: Callable[[], int] | None) -> None:
    """Have ``RankShare.current`` ask ``source`` for the smallest share when the
    environment does not say (``source`` may block until the shares are written, and
    raises ``DataError`` when one is empty)."""
    global _min_rows_source
    _min_rows_source = source


def _min_rows() -> int:
    rows = _env.get_int(_env.SHARE_MIN_ROWS, 0) or 0
    if rows or _min_rows_source is None:
        return rows
    return _min_rows_source()


def write_share(batches: Iterator[Any], path: str) -> int:
    """Stream a Spark task's Arrow record batches into the share file ``path``.

    Runs in the rank's Spark task (a thread of it) while the rank starts: one record batch
    in memory at a time (Spark's ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows).
    Returns the rows.
    """
    import pyarrow as pa

    rows = 0
    writer = None
    try:
        for batch in batches:
            if writer is None:
                writer = pa.ipc.new_file(path, batch.schema)
            writer.write_batch(batch)
            rows += batch.num_rows
    finally:
        if writer is not None:
            writer.close()
    return rows


def share_directory() -> str:
    """The executor's local scratch directory (Spark's ``SPARK_LOCAL_DIRS``, the first one),
    else the system's temporary directory: local disk, never a shared filesystem."""
    import os
    import tempfile

    dirs = [d for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d]
    return dirs[0] if dirs else tempfile.gettempdir()
