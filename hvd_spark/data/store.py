"""Stores: where datasets, checkpoints and logs of training runs live.

A ``Store`` wraps one ``pyarrow.fs`` filesystem picked from its prefix URL (local paths
and ``file://``, ``dbfs:/``, ``hdfs://``, ``s3://``/``s3a://``, ``gs://``, ... see
``hvd_spark.data.filesystems``) and gives every run the same layout under the prefix::

    <prefix>/intermediate_train_data/<dataset key>/{train,val}/part-*.parquet, spec.json
    <prefix>/intermediate_train_data.<idx>, intermediate_val_data.<idx>  (Horovod's prepare_data)
    <prefix>/runs/<run_id>/checkpoints/epoch-000003.ckpt
    <prefix>/runs/<run_id>/logs/

The constructors and the ``get_*`` methods have Horovod's signatures and meaning (they
return full URLs, ``file:///...`` for local stores); ``train_path`` and ``runs_path`` move
the dataset cache and the runs. Every method that takes a path accepts a full path or URL
on the store's filesystem, or a path relative to the prefix.

Stores travel to Spark tasks and workers by pickle: the URL and options are kept, the
filesystem is re-created lazily in the process that uses it (credentials not given in
``storage_options`` come from that process' environment, as pyarrow reads them).
"""

from __future__ import annotations

import logging
import posixpath
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from pyarrow import fs as pafs

from hvd_spark.data import filesystems
from hvd_spark.data.filesystems import filesystem_from_url, join_url
from hvd_spark.data.store_files import StoreFiles
from hvd_spark.errors import ConfigError

__all__ = ["AbstractFilesystemStore", "DBFSLocalStore", "FilesystemStore", "HDFSStore",
           "LocalStore", "Store", "filesystem_from_url", "join_url"]

log = logging.getLogger(__name__)

INTERMEDIATE_DIR = "intermediate_train_data"
VAL_DIR = "intermediate_val_data"
TEST_DIR = "intermediate_test_data"
RUNS_DIR = "runs"
LOGS_SUBDIR = "logs"
SPEC_FILE = "spec.json"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._=-][A-Za-z0-9._=+-]*$")
_PATH_KINDS = ("train", "val", "test", "runs")


class Store(StoreFiles):
    """A training-data and checkpoint store on any pyarrow filesystem.

    Args:
        prefix_path: Local path or URL under which everything is kept.
        train_path: Where the training data goes (default ``<prefix>/intermediate_train_data``).
        val_path: Base of ``get_val_data_path`` (default ``<prefix>/intermediate_val_data``).
        test_path: Base of ``get_test_data_path`` (default ``<prefix>/intermediate_test_data``).
        runs_path: Where runs (checkpoints, logs) go (default ``<prefix>/runs``).
        save_runs: Keep checkpoints and logs; False: ``save_checkpoint`` writes nothing.
        storage_options: Filesystem options: pyarrow's keywords (``S3FileSystem``,
            ``HadoopFileSystem``, ...) or s3fs's (``key``, ``secret``, ``client_kwargs``).
        checkpoint_filename: What ``get_checkpoint_filename`` returns (default ``checkpoint``).
        **kwargs: Other Horovod keywords; accepted and ignored with one log line.
    """

    def __init__(self, prefix_path: str, train_path: str | None = None,
                 val_path: str | None = None, test_path: str | None = None,
                 runs_path: str | None = None, save_runs: bool = True,
                 storage_options: dict[str, Any] | None = None,
                 checkpoint_filename: str | None = None, **kwargs: Any) -> None:
        if not isinstance(prefix_path, str) or not prefix_path:
            raise ConfigError(f"store prefix must be a non-empty path or URL, got {prefix_path!r}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a dict, got {storage_options!r}")
        if kwargs:
            log.info("%s ignores %s (Horovod keywords with no meaning here)",
                     type(self).__name__, sorted(kwargs))
        if filesystems.is_local(prefix_path):
            prefix_path = filesystems.local_path(prefix_path)
        self._url = prefix_path.rstrip("/") if len(prefix_path) > 1 else prefix_path
        self._options = dict(storage_options or {})
        self._save_runs = bool(save_runs)
        self._checkpoint_filename = checkpoint_filename or "checkpoint"
        given = dict(zip(_PATH_KINDS, (train_path, val_path, test_path, runs_path)))
        self._custom = {k: self._full(v) for k, v in given.items() if v is not None}
        self._fs: pafs.FileSystem | None = None
        self._base = ""
        self._register()

    @classmethod
    def create(cls, prefix_path: str | Store, *args: Any, **kwargs: Any) -> Store:
        """Return the store for ``prefix_path``, choosing the class from its scheme.

        ``hdfs://`` -> ``HDFSStore``; ``dbfs:/``, ``/dbfs/`` -> ``DBFSLocalStore``; other
        local paths -> ``LocalStore``; other URLs (``s3://``, ``s3a://``, ``gs://``, ...)
        -> ``FilesystemStore``. ``args`` and ``kwargs`` go to that class. A Store is
        returned as it is.
        """
        if isinstance(prefix_path, Store):
            return prefix_path
        if not isinstance(prefix_path, str) or not prefix_path:
            raise ConfigError(f"store prefix must be a non-empty path or URL, got {prefix_path!r}")
        if HDFSStore.matches(prefix_path):
            return HDFSStore(prefix_path, *args, **kwargs)
        if DBFSLocalStore.matches_dbfs(prefix_path):
            return DBFSLocalStore(prefix_path, *args, **kwargs)
        if filesystems.is_local(prefix_path):
            return LocalStore(prefix_path, *args, **kwargs)
        return FilesystemStore(prefix_path, *args, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._url!r})"

    def __eq__(self, other: object) -> bool:
        return (type(other) is type(self) and other.url == self.url
                and other._custom == self._custom)

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._url))

    def __getstate__(self) -> dict[str, Any]:
        # The filesystem object may hold sockets: rebuild it where it is used.
        return {k: v for k, v in self.__dict__.items() if k not in ("_fs", "_base")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fs = None
        self._base = ""
        self._register()

    def _register(self) -> None:
        # Plain URLs of this store's bucket/host (model.save, a spec's root_url) then
        # reach the same endpoint with the same credentials in this process.
        options = {**filesystems.url_options(self._url), **self._options}
        filesystems.register_options(self._url, options)

    @property
    def url(self) -> str:
        """The normalized prefix (absolute path for local stores)."""
        return self._url

    @property
    def filesystem(self) -> pafs.FileSystem:
        """The pyarrow filesystem, created on first use in this process."""
        if self._fs is None:
            self._fs, base = filesystem_from_url(self._url, self._options or None)
            self._base = base.rstrip("/") or "/"
        return self._fs

    @property
    def fs(self) -> pafs.FileSystem:
        """Horovod's name for ``filesystem``."""
        return self.filesystem

    def get_filesystem(self) -> pafs.FileSystem:
        """The pyarrow filesystem (Horovod's ``FilesystemStore.get_filesystem``)."""
        return self.filesystem

    # Paths ----------------------------------------------------------------------------

    def _is_full(self, path: str) -> bool:
        return bool(filesystems.scheme_of(path)) or path.startswith(("/", "file:", "dbfs:"))

    def _full(self, path: str) -> str:
        """A full path/URL for ``path`` (relative paths are under the prefix)."""
        if not isinstance(path, str) or not path:
            raise ConfigError(f"a store path must be a non-empty string, got {path!r}")
        if path.startswith("/") and not filesystems.is_local(self._url):
            split = urlsplit(self._url)  # absolute on this store's bucket or namenode
            return filesystems.unsplit(split._replace(path=path, query=""))
        return path if self._is_full(path) else join_url(self._url, path)

    def path(self, *parts: str) -> str:
        """Filesystem path (for ``self.filesystem``) of ``parts``.

        The first part may be a full path or URL on this store's filesystem; otherwise
        all parts are relative to the prefix.
        """
        self.filesystem  # noqa: B018 - resolves the base path
        parts = tuple(p for p in parts if p)
        if parts and self._is_full(parts[0]):
            base = self.get_localized_path(parts[0]).rstrip("/") or "/"
            parts = parts[1:]
        else:
            base = self._base
        parts = tuple(p.strip("/") for p in parts)
        return posixpath.join(base, *parts) if parts else base

    def url_of(self, *parts: str) -> str:
        """URL (or local path) of ``parts`` (see ``path``), openable in another process."""
        if parts and parts[0] and self._is_full(parts[0]):
            return join_url(self._full(parts[0]), *parts[1:])
        return join_url(self._url, *parts)

    def get_full_path(self, path: str) -> str:
        """Full URL of ``path`` (relative paths are taken under the prefix).

        Local stores return ``file:///...`` URIs, as Horovod's do, so that Spark reads them
        from the local filesystem whatever its default filesystem is.
        """
        return filesystems.strip_query(self._full(path))

    def get_full_path_fn(self) -> Callable[[str], str]:
        """A picklable function doing ``get_full_path``."""
        return self.get_full_path

    def get_localized_path(self, path: str) -> str:
        """The path of ``path`` on ``self.filesystem`` (no scheme, host or query)."""
        if not self._is_full(path):
            return self.path(path)
        path = self._full(path)
        if filesystems.is_local(path) != filesystems.is_local(self._url):
            raise ConfigError(f"{path!r} is not on the filesystem of store {self._url!r}")
        if filesystems.is_local(path):
            return filesystems.local_path(path)
        if filesystems.scheme_of(path) != filesystems.scheme_of(self._url):
            raise ConfigError(f"{path!r} is not on the filesystem of store {self._url!r}")
        split = urlsplit(filesystems.normalize_url(path))
        if filesystems.scheme_of(path) == "hdfs":
            return split.path or "/"
        return (split.netloc.rpartition("@")[2] + split.path).rstrip("/")

    def relative(self, path: str) -> str | None:
        """``path`` relative to the prefix, or None if it is not under the prefix."""
        inner = self.get_localized_path(path) if self._is_full(path) else self.path(path)
        base = self.path()
        if inner == base:
            return ""
        return inner[len(base) + 1:] if inner.startswith(base.rstrip("/") + "/") else None

    # Layout ---------------------------------------------------------------------------

    def _base_of(self, kind: str, default: str) -> str:
        return self._custom.get(kind, default)

    def dataset_path(self, key: str) -> str:
        """Directory of the cached dataset with key ``key`` (under the train path)."""
        return posixpath.join(self._base_of("train", INTERMEDIATE_DIR),
                              _checked_name(key, "dataset key"))

    def data_path(self, key: str, split: str) -> str:
        """Directory of the Parquet files of ``split`` ("train" or "val")."""
        if split not in ("train", "val"):
            raise ConfigError(f"split must be 'train' or 'val', got {split!r}")
        return posixpath.join(self.dataset_path(key), split)

    def train_data_path(self, key: str) -> str:
        """Directory of the training Parquet files of dataset ``key``."""
        return self.data_path(key, "train")

    def val_data_path(self, key: str) -> str:
        """Directory of the validation Parquet files of dataset ``key``."""
        return self.data_path(key, "val")

    def spec_path(self, key: str) -> str:
        """Path of the dataset's spec file, written last as its commit marker."""
        return posixpath.join(self.dataset_path(key), SPEC_FILE)

    def run_path(self, run_id: str) -> str:
        """Directory of run ``run_id`` (relative unless ``runs_path`` was given)."""
        return posixpath.join(self._base_of("runs", RUNS_DIR), _checked_name(run_id, "run_id"))

    def checkpoints_path(self, run_id: str) -> str:
        """Directory of the checkpoints of run ``run_id``."""
        return posixpath.join(self.run_path(run_id), "checkpoints")

    def logs_path(self, run_id: str) -> str:
        """Directory of the logs of run ``run_id``."""
        return posixpath.join(self.run_path(run_id), LOGS_SUBDIR)

    # Horovod's getters: full URLs -----------------------------------------------------

    def _indexed(self, kind: str, default: str, idx: int | None) -> str:
        base = self.get_full_path(self._base_of(kind, default))
        return base if idx is None else f"{base}.{idx}"

    def get_train_data_path(self, idx: int | None = None) -> str:
        """Training data path; with ``idx``, that of dataset ``idx`` (Horovod's prepare_data)."""
        return self._indexed("train", INTERMEDIATE_DIR, idx)

    def get_val_data_path(self, idx: int | None = None) -> str:
        """Validation data path; with ``idx``, that of dataset ``idx`` (Horovod's prepare_data)."""
        return self._indexed("val", VAL_DIR, idx)

    def get_test_data_path(self, idx: int | None = None) -> str:
        """Test data path (``.<idx>`` appended when given)."""
        return self._indexed("test", TEST_DIR, idx)

    def saving_runs(self) -> bool:
        """Whether checkpoints and logs of runs are kept (``save_runs``)."""
        return self._save_runs

    def get_runs_path(self) -> str:
        """Base path of all runs."""
        return self.get_full_path(self._base_of("runs", RUNS_DIR))

    def get_run_path(self, run_id: str) -> str:
        """Path of run ``run_id``."""
        return self.get_full_path(self.run_path(run_id))

    def get_checkpoint_path(self, run_id: str) -> str | None:
        """Directory of the checkpoints of ``run_id``; None when runs are not saved."""
        return self.get_full_path(self.checkpoints_path(run_id)) if self._save_runs else None

    def get_checkpoints(self, run_id: str, suffix: str = ".ckpt") -> list[str]:
        """Full paths of the checkpoint files of ``run_id`` ending in ``suffix``, sorted."""
        directory = self.checkpoints_path(run_id)
        return [self.get_full_path(posixpath.join(directory, name))
                for name in self.list_files(directory) if name.endswith(suffix)]

    def get_logs_path(self, run_id: str) -> str | None:
        """Directory of the logs of ``run_id``; None when runs are not saved."""
        return self.get_full_path(self.logs_path(run_id)) if self._save_runs else None

    def get_checkpoint_filename(self) -> str:
        """Base name Horovod gives a checkpoint file (``checkpoint_filename``)."""
        return self._checkpoint_filename

    def get_logs_subdir(self) -> str:
        """Name of the logs directory inside a run."""
        return LOGS_SUBDIR

    @staticmethod
    def matches(path: str) -> bool:
        """Whether this class handles ``path`` (any URL for the generic store)."""
        return isinstance(path, str)


AbstractFilesystemStore = Store


class FilesystemStore(Store):
    """A store on any filesystem pyarrow supports (``s3://``, ``s3a://``, ``gs://``, local, ...)."""


class LocalStore(FilesystemStore):
    """A store on the local (or a mounted shared) filesystem."""

    def __init__(self, prefix_path: str, *args: Any, **kwargs: Any) -> None:
        if not isinstance(prefix_path, str) or not filesystems.is_local(prefix_path):
            raise ConfigError(f"LocalStore needs a local path or file:// URL, got {prefix_path!r}")
        super().__init__(prefix_path, *args, **kwargs)

    def get_full_path(self, path: str) -> str:
        """``file:///...`` URI of ``path`` (relative paths are under the prefix)."""
        return "file://" + filesystems.local_path(self._full(path))


class HDFSStore(Store):
    """A store on HDFS; needs libhdfs (and a Hadoop client) where it is used.

    Args:
        prefix_path: ``hdfs://namenode:8020/path``, ``hdfs:///path`` or ``/path``.
        host: Namenode host; default: from the URL, else ``fs.defaultFS`` (``"default"``).
        port: Namenode port; default: from the URL.
        user: HDFS user name.
        kerb_ticket: Path of the Kerberos ticket cache.
        driver: Ignored: pyarrow has only ``libhdfs`` (Horovod's default).
        extra_conf: Extra Hadoop configuration, overriding ``hdfs-site.xml``.
        *args: The other ``Store`` arguments, by position.
        **kwargs: The other ``Store`` arguments, by name.

    The filesystem is created on first use, so constructing the store needs no HDFS.
    """

    def __init__(self, prefix_path: str, host: str | None = None, port: int | None = None,
                 user: str | None = None, kerb_ticket: str | None = None,
                 driver: str = "libhdfs", extra_conf: dict[str, str] | None = None,
                 *args: Any, **kwargs: Any) -> None:
        if isinstance(prefix_path, str) and prefix_path.startswith("/"):
            prefix_path = "hdfs://" + prefix_path
        if not isinstance(prefix_path, str) or not self.matches(prefix_path):
            raise ConfigError(
                f"HDFSStore needs an hdfs:// URL (or an absolute HDFS path), got {prefix_path!r}"
            )
        if not urlsplit(prefix_path).path.strip("/"):
            raise ConfigError(f"HDFSStore needs a path after the namenode in {prefix_path!r}")
        if driver != "libhdfs":
            log.info("HDFSStore ignores driver=%r: pyarrow connects through libhdfs", driver)
        options = dict(kwargs.pop("storage_options", None) or {})
        given = {"host": host, "port": port, "user": user, "kerb_ticket": kerb_ticket,
                 "extra_conf": extra_conf}
        options.update({k: v for k, v in given.items() if v is not None})
        super().__init__(prefix_path, *args, storage_options=options, **kwargs)

    @staticmethod
    def matches(path: str) -> bool:
        """Whether ``path`` is an ``hdfs://`` URL."""
        return isinstance(path, str) and path.startswith("hdfs://")


class DBFSLocalStore(LocalStore):
    """A Databricks DBFS store used through its local FUSE mount: ``dbfs:/x`` -> ``/dbfs/x``.

    Takes ``dbfs:/...``, ``/dbfs/...``, ``file:/dbfs/...`` and ``file:///dbfs/...``.
    """

    def __init__(self, prefix_path: str, *args: Any, **kwargs: Any) -> None:
        if not isinstance(prefix_path, str):
            raise ConfigError(f"DBFSLocalStore needs a DBFS path, got {prefix_path!r}")
        if len(args) < 7:  # Horovod's DBFS checkpoint is a TensorFlow SavedModel directory
            kwargs.setdefault("checkpoint_filename", "checkpoint.tf")
        super().__init__(filesystems.dbfs_local_path(prefix_path), *args, **kwargs)

    @staticmethod
    def matches_dbfs(path: str) -> bool:
        """Whether ``path`` names a DBFS location."""
        try:
            filesystems.dbfs_local_path(path)
        except (ConfigError, TypeError, AttributeError):
            return False
        return True

    @staticmethod
    def normalize_path(path: str) -> str:
        """The ``/dbfs/...`` form of a DBFS path."""
        return filesystems.dbfs_local_path(path)



def _checked_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name in (".", ".."):
        raise ConfigError(
            f"{what} must be a non-empty name of letters, digits and ._=+- (no '/'), got {name!r}"
        )
    return name
