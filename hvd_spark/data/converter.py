"""``make_converter``: petastorm's ``make_spark_converter`` for ``hvd_spark.run``.

The pattern of Databricks' docs, with petastorm (which does not import with
pyarrow >= 16) replaced::

    from hvd_spark.data import make_converter

    converter = make_converter(df)                      # driver: caches df in a Store

    def train():
        import hvd_spark.torch as hvd
        hvd.init()
        with converter.make_torch_dataloader(batch_size=32, num_epochs=1) as loader:
            for batch in loader:                        # dict column -> torch.Tensor
                ...

    hvd_spark.run(train, num_proc=2)                    # converter ships in the closure

The DataFrame is written by ``hvd_spark.data.writer.write_dataset`` (checked for nulls,
NaN, ragged arrays and unsupported types before anything is written) and cached by
content: the same data with the same columns and file count reuses the files, in any
session, without writing. ``Converter`` holds only the dataset spec, the Store and the
float dtype, so it pickles small and reads from any process that reaches the Store.
"""

from __future__ import annotations

import logging
import os
import posixpath
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from hvd_spark import _loaders
from hvd_spark.data.converter_loaders import BatchStream, resolve_shard
from hvd_spark.data.reader import ShardReader
from hvd_spark.data.spec import DatasetSpec
from hvd_spark.data.store import Store
from hvd_spark.errors import ConfigError, DataError

log = logging.getLogger(__name__)

# Spark confs naming the default cache location; petastorm's key keeps its notebooks working.
CACHE_DIR_CONFS = ("hvd_spark.converter.parentCacheDirUrl",
                   "petastorm.spark.converter.parentCacheDirUrl")
DEFAULT_NUM_FILES = 8  # without a sparkContext (Spark Connect); else its default parallelism


def make_converter(
    df: Any,
    store: Store | str | None = None,
    *,
    columns: Sequence[str] | None = None,
    dtype: str | None = "float32",
    num_files: int | None = None,
) -> Converter:
    """Cache ``df`` as Parquet in ``store`` (or reuse the cached copy) and return a converter.

    Args:
        df: A pyspark DataFrame of numbers, arrays of numbers and ML Vectors.
        store: A Store, or a path/URL every executor can reach. Default: the Spark conf
            ``hvd_spark.converter.parentCacheDirUrl`` (or petastorm's
            ``petastorm.spark.converter.parentCacheDirUrl``), else, on a ``local``
            master only, a directory under the system's temporary directory.
        columns: Columns to keep; default all of ``df``'s.
        dtype: What floating-point columns are handed out as: ``"float32"`` (the default,
            as petastorm's: what models train in, half the memory of Spark's doubles),
            ``"float64"``, or None to keep each column's width. Applied when reading,
            so converters with different dtypes share the cached files. Integer columns
            are always int64 and stay integers.
        num_files: Parquet files to write (Spark tasks writing at once); default the
            SparkContext's default parallelism. Part of the cache key.

    Returns:
        A picklable ``Converter``; ``len(converter)`` is the number of rows.

    Raises:
        ConfigError: A setting cannot work, or no store was given on a cluster.
        DataError: A column cannot be converted (the message names it and the fix).
    """
    from hvd_spark.data import writer  # driver only: keeps the workers' imports lean

    float_dtype = _float_dtype(dtype)
    names = list(df.columns) if columns is None else _names(columns)
    if not names:
        raise ConfigError("the DataFrame has no columns to convert")
    if num_files is None:
        num_files = _default_num_files(df)
    if not isinstance(num_files, int) or isinstance(num_files, bool) or num_files < 1:
        raise ConfigError(f"num_files must be an int >= 1, got {num_files!r}")
    store = _resolve_store(df, store)
    try:
        # One "process" of num_files partitions: rows >= 1 is the only size check, and
        # the cache key (content, columns, file count) is the writer's own.
        spec = writer.write_dataset(df, store, feature_cols=names, num_proc=1, batch_size=1,
                                   partitions_per_process=num_files)
    except DataError as exc:
        if columns is not None:
            raise
        raise DataError(f"{exc}. make_converter converts every column of the DataFrame "
                        "unless columns=[...] names the ones to keep") from exc
    return Converter(spec, store, dtype=None if float_dtype is None else float_dtype.name)


class Converter:
    """A DataFrame cached in a Store, read by each rank as its share of equal-size batches.

    Made by ``make_converter`` on the driver and pickled into ``run()``'s function; its
    loaders read the Parquet files directly (pyarrow, no Spark in the ranks).

    Args:
        spec: The dataset spec the writer returned.
        store: The Store holding the dataset.
        dtype: Float dtype handed out (see ``make_converter``); None keeps the widths.
    """

    def __init__(self, spec: DatasetSpec, store: Store | str,
                 dtype: str | None = "float32") -> None:
        self._spec = spec
        self._store = Store.create(store)
        self._float_dtype = _float_dtype(dtype)

    def __len__(self) -> int:
        return self._spec.train.num_rows

    def __repr__(self) -> str:
        return (f"Converter({len(self)} rows, columns={self.columns}, "
                f"cache_dir_url={self.cache_dir_url!r})")

    @property
    def dataset_size(self) -> int:
        """Rows in the dataset (petastorm's name for ``len(converter)``)."""
        return len(self)

    @property
    def columns(self) -> list[str]:
        """Column names, in the DataFrame's order."""
        return self._spec.column_names

    @property
    def cache_dir_url(self) -> str:
        """URL of the cached dataset's directory."""
        return self._spec.root_url

    @property
    def file_urls(self) -> list[str]:
        """URLs of the cached Parquet files."""
        return [posixpath.join(self._spec.root_url, f) for f in self._spec.train.files]

    @property
    def spec(self) -> DatasetSpec:
        """The dataset spec (columns, dtypes, shapes, files)."""
        return self._spec

    def make_torch_dataloader(
        self,
        batch_size: int = 32,
        num_epochs: int | None = None,
        shuffle: bool = True,
        cur_shard: int | None = None,
        shard_count: int | None = None,
        *,
        seed: int = 0,
        device: Any = None,
        columns: Sequence[str] | None = None,
        shuffling_queue_capacity: int | None = None,
        workers_count: int | None = None,
    ) -> Any:
        """A loader of this shard's batches as dicts ``column -> torch.Tensor``.

        A ``hvd_spark.torch.data.TorchLoader``, which ``import hvd_spark.torch`` provides
        (the data layer imports no framework). Use it as a context manager (``with ... as
        loader:``), which stops its reading threads on exit; it is also the iterable itself.

        Args:
            batch_size: Rows per batch on this rank.
            num_epochs: Epochs per iteration of the loader; None (petastorm's default):
                it never ends, so count steps with ``loader.steps_per_epoch``.
            shuffle: Shuffle the row groups and rows, differently each epoch.
            cur_shard: This rank's shard; with ``shard_count``, default ``hvd.rank()``
                and ``hvd.size()`` inside ``run()``, else ``0`` and ``1``.
            shard_count: Number of shards (ranks).
            seed: Shuffle seed; must be the same on every rank (shards are cut from one
                global order).
            device: torch device to move the tensors to (e.g. ``"cuda"``).
            columns: Columns to read; default all.
            shuffling_queue_capacity: Rows mixed in the shuffle buffer (petastorm's
                name); 0 reads the rows in order (``shuffle=False``).
            workers_count: Row groups decoded in parallel (petastorm's name).

        Raises:
            ConfigError: A bad argument, or ``hvd_spark.torch`` not imported. DataError:
            The cache was deleted, or too few rows for one batch per shard.
        """
        stream = self._stream(batch_size, num_epochs, shuffle, cur_shard, shard_count, seed,
                              columns, shuffling_queue_capacity, workers_count)
        return _framework_loader("torch", stream, device=device)

    def make_tf_dataset(
        self,
        batch_size: int = 32,
        num_epochs: int | None = None,
        shuffle: bool = True,
        cur_shard: int | None = None,
        shard_count: int | None = None,
        *,
        seed: int = 0,
        columns: Sequence[str] | None = None,
        shuffling_queue_capacity: int | None = None,
        workers_count: int | None = None,
    ) -> Any:
        """A context manager yielding a ``tf.data.Dataset`` of this shard's batches.

        Elements are dicts ``column -> tf.Tensor`` (petastorm yields namedtuples:
        ``x.features`` becomes ``x["features"]``); integer columns are ``tf.int64``,
        floats ``tf.float32`` by default. A ``hvd_spark.tensorflow.data.TFDatasetContext``,
        which ``import hvd_spark.tensorflow`` provides. Arguments as for
        ``make_torch_dataloader``.
        """
        stream = self._stream(batch_size, num_epochs, shuffle, cur_shard, shard_count, seed,
                              columns, shuffling_queue_capacity, workers_count)
        return _framework_loader("tensorflow", stream)

    def delete(self) -> None:
        """Delete the cached files (every converter of the same data and settings shares them)."""
        self._store.delete(self._store.dataset_path(self._spec.key))

    def _stream(self, batch_size: int, num_epochs: int | None, shuffle: bool,
                cur_shard: int | None, shard_count: int | None, seed: int,
                columns: Sequence[str] | None, shuffling_queue_capacity: int | None,
                workers_count: int | None) -> BatchStream:
        rank, size = resolve_shard(cur_shard, shard_count)
        if not self._store.exists(self._store.spec_path(self._spec.key)):
            raise DataError(f"the cached data at {self.cache_dir_url} is gone (converter.delete() "
                            "or removed files): make a new converter with make_converter(df)")
        if shuffling_queue_capacity == 0:
            shuffle = False
        wanted = None if columns is None else _names(columns)
        missing = [c for c in wanted or () if c not in self.columns]
        if missing:
            raise ConfigError(f"column(s) {missing} are not in the converter; it has: "
                              f"{', '.join(self.columns)}")
        reader = ShardReader(self._spec, rank, size, batch_size, columns=wanted,
                             shuffle=shuffle, seed=seed,
                             shuffle_buffer_size=shuffling_queue_capacity or None,
                             num_threads=workers_count)
        return BatchStream(reader, num_epochs, self._float_dtype)


def _framework_loader(framework: str, stream: BatchStream, **options: Any) -> Any:
    """The loader that ``framework``'s binding registered, over ``stream``."""
    try:
        factory = _loaders.loader(framework)
    except ConfigError:
        stream.close()  # its reader may have started threads
        raise
    return factory(stream, **options)


def _float_dtype(dtype: Any) -> np.dtype | None:
    if dtype is None:
        return None
    try:
        result = np.dtype(dtype)
    except TypeError:
        result = None
    if result is None or not np.issubdtype(result, np.floating):
        raise ConfigError(f"dtype must be 'float32', 'float64' or None (keep each float "
                          f"column's width), got {dtype!r}")
    return result


def _names(columns: Sequence[str] | str) -> list[str]:
    names = [columns] if isinstance(columns, str) else list(columns)
    if not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"columns must be column names (strings), got {columns!r}")
    return names


def _default_num_files(df: Any) -> int:
    try:
        return max(1, int(df.sparkSession.sparkContext.defaultParallelism))
    except Exception:  # noqa: BLE001 - Spark Connect has no sparkContext
        return DEFAULT_NUM_FILES


def _resolve_store(df: Any, store: Store | str | None) -> Store:
    if store is not None:
        return Store.create(store)
    conf = df.sparkSession.conf
    for key in CACHE_DIR_CONFS:
        url = conf.get(key, None)
        if url:
            return Store.create(url)
    master = conf.get("spark.master", None) or ""
    if master.startswith("local"):
        path = os.path.join(tempfile.gettempdir(), "hvd_spark_converter_cache")
        log.info("make_converter caches the DataFrame under %s (local master; pass store=... "
                 "or set %s on a cluster)", path, CACHE_DIR_CONFS[0])
        return Store.create(path)
    raise ConfigError(
        f"make_converter needs a store every executor can read, and master {master!r} is not "
        "local: pass store=... (a path or URL, e.g. 'dbfs:/tmp/converter_cache' or "
        f"'s3://bucket/cache') or set the Spark conf {CACHE_DIR_CONFS[0]}")
