"""Stores: where datasets, checkpoints and logs of training runs live.

A ``Store`` wraps one ``pyarrow.fs`` filesystem picked from a URL (local paths and
``file://``, ``hdfs://``, ``s3://``, ``gs://``, ... whatever pyarrow supports) and
gives every run the same layout under its prefix::

    <prefix>/intermediate_train_data/<dataset key>/{train,val}/part-*.parquet, spec.json
    <prefix>/runs/<run_id>/checkpoints/epoch-000003.ckpt
    <prefix>/runs/<run_id>/logs/

Paths taken and returned by the methods are relative to the prefix. Stores travel to
Spark tasks and workers by pickle: only the URL is kept, the filesystem is re-created
lazily in the process that uses it (credentials come from that process' environment,
as pyarrow reads them, e.g. ``AWS_ACCESS_KEY_ID``).
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import uuid
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pyarrow import fs as pafs

from hvd_spark.errors import ConfigError

INTERMEDIATE_DIR = "intermediate_train_data"
RUNS_DIR = "runs"
SPEC_FILE = "spec.json"
_CHECKPOINT_RE = re.compile(r"^epoch-(\d+)\.ckpt$")
_TEMP_MARK = ".tmp-"
# Filesystems where a rename is cheap and atomic; object stores publish a PUT atomically.
_RENAME_ATOMIC = {"local", "hdfs"}
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._=-][A-Za-z0-9._=+-]*$")


def _is_local(prefix: str) -> bool:
    scheme = urlsplit(prefix).scheme
    # A one-letter scheme is a Windows drive letter, not a URL scheme.
    return scheme in ("", "file") or len(scheme) == 1


def join_url(url: str, *parts: str) -> str:
    """Join path ``parts`` onto ``url``, keeping its scheme, host and query string.

    Args:
        url: A local path or a URL such as ``s3://bucket/prefix?endpoint_override=...``.
        *parts: Relative path components (``/``-separated).

    Returns:
        The joined path or URL.
    """
    parts = tuple(p.strip("/") for p in parts if p)
    if _is_local(url) and urlsplit(url).scheme != "file":
        return os.path.join(url, *parts)
    split = urlsplit(url)
    return urlunsplit(split._replace(path=posixpath.join(split.path or "/", *parts)))


def filesystem_from_url(url: str) -> tuple[pafs.FileSystem, str]:
    """Return ``(filesystem, path)`` for a local path or URL, with a clear error if unsupported."""
    try:
        return pafs.FileSystem.from_uri(url)
    except (ValueError, OSError) as exc:  # pyarrow raises ArrowInvalid/ArrowIOError (subclasses)
        raise ConfigError(
            f"cannot open a filesystem for {url!r}: {exc}. Use a local path or a URL pyarrow "
            "supports (file://, hdfs://, s3://, gs://, abfs://) and check the credentials"
        ) from exc


class Store:
    """A training-data and checkpoint store on any pyarrow filesystem.

    Args:
        prefix: Local path or URL under which everything is kept.
    """

    def __init__(self, prefix: str) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise ConfigError(f"store prefix must be a non-empty path or URL, got {prefix!r}")
        if _is_local(prefix):
            path = urlsplit(prefix).path if prefix.startswith("file:") else prefix
            prefix = os.path.abspath(os.path.expanduser(path))
        self._url = prefix.rstrip("/") if len(prefix) > 1 else prefix
        self._fs: pafs.FileSystem | None = None
        self._base = ""

    @classmethod
    def create(cls, prefix: str) -> Store:
        """Return the store for ``prefix``, choosing the class from its scheme."""
        if isinstance(prefix, Store):
            return prefix
        if isinstance(prefix, str) and prefix.startswith("dbfs:"):
            return DBFSLocalStore(prefix)
        if isinstance(prefix, str) and prefix.startswith("hdfs:"):
            return HDFSStore(prefix)
        if isinstance(prefix, str) and _is_local(prefix):
            return LocalStore(prefix)
        return Store(prefix)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._url!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.url == self.url

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._url))

    def __getstate__(self) -> dict[str, Any]:
        # The filesystem object may hold sockets or credentials: rebuild it where used.
        return {"_url": self._url}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._url = state["_url"]
        self._fs = None
        self._base = ""

    @property
    def url(self) -> str:
        """The normalized prefix (absolute path for local stores)."""
        return self._url

    @property
    def filesystem(self) -> pafs.FileSystem:
        """The pyarrow filesystem, created on first use in this process."""
        if self._fs is None:
            self._fs, base = filesystem_from_url(self._url)
            self._base = base.rstrip("/") or "/"
        return self._fs

    def path(self, *parts: str) -> str:
        """Filesystem path (for ``self.filesystem``) of ``parts`` under the prefix."""
        self.filesystem  # noqa: B018 - resolves the base path
        parts = tuple(p.strip("/") for p in parts if p)
        return posixpath.join(self._base, *parts) if parts else self._base

    def url_of(self, *parts: str) -> str:
        """URL (or local path) of ``parts`` under the prefix, openable in another process."""
        return join_url(self._url, *parts)

    # Layout ---------------------------------------------------------------------------

    def dataset_path(self, key: str) -> str:
        """Relative directory of the dataset with cache key ``key``."""
        return posixpath.join(INTERMEDIATE_DIR, _checked_name(key, "dataset key"))

    def data_path(self, key: str, split: str) -> str:
        """Relative directory of the Parquet files of ``split`` ("train" or "val")."""
        if split not in ("train", "val"):
            raise ConfigError(f"split must be 'train' or 'val', got {split!r}")
        return posixpath.join(self.dataset_path(key), split)

    def train_data_path(self, key: str) -> str:
        """Relative directory of the training Parquet files of dataset ``key``."""
        return self.data_path(key, "train")

    def val_data_path(self, key: str) -> str:
        """Relative directory of the validation Parquet files of dataset ``key``."""
        return self.data_path(key, "val")

    def spec_path(self, key: str) -> str:
        """Relative path of the dataset's spec file, written last as its commit marker."""
        return posixpath.join(self.dataset_path(key), SPEC_FILE)

    def run_path(self, run_id: str) -> str:
        """Relative directory of run ``run_id``."""
        return posixpath.join(RUNS_DIR, _checked_name(run_id, "run_id"))

    def checkpoints_path(self, run_id: str) -> str:
        """Relative directory of the checkpoints of run ``run_id``."""
        return posixpath.join(self.run_path(run_id), "checkpoints")

    def logs_path(self, run_id: str) -> str:
        """Relative directory of the logs of run ``run_id``."""
        return posixpath.join(self.run_path(run_id), "logs")

    # Files ----------------------------------------------------------------------------

    def exists(self, rel: str) -> bool:
        """Whether a file or directory exists at ``rel``."""
        info = self.filesystem.get_file_info(self.path(rel))
        return info.type != pafs.FileType.NotFound

    def read_bytes(self, rel: str) -> bytes:
        """Contents of the file at ``rel``; FileNotFoundError if it is missing."""
        with self.filesystem.open_input_stream(self.path(rel)) as stream:
            return stream.read()

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write ``data`` to ``rel`` so that readers never see a partial file.

        On local and HDFS filesystems the data goes to a temporary name first and is
        renamed into place; object stores (S3, GCS) publish an upload atomically anyway.
        """
        fs = self.filesystem
        target = self.path(rel)
        fs.create_dir(posixpath.dirname(target), recursive=True)
        if fs.type_name not in _RENAME_ATOMIC:
            with fs.open_output_stream(target) as out:
                out.write(data)
            return
        temp = f"{target}{_TEMP_MARK}{uuid.uuid4().hex}"
        try:
            with fs.open_output_stream(temp) as out:
                out.write(data)
            fs.move(temp, target)
        except BaseException:
            _delete_quietly(fs, temp)
            raise

    def delete(self, rel: str) -> None:
        """Delete the file or directory tree at ``rel`` (no error if it is missing)."""
        fs = self.filesystem
        path = self.path(rel)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(path)
        elif info.type != pafs.FileType.NotFound:
            fs.delete_file(path)

    def list_files(self, rel: str) -> list[str]:
        """Names of the files directly under directory ``rel`` (empty if it is missing)."""
        selector = pafs.FileSelector(self.path(rel), allow_not_found=True)
        infos = self.filesystem.get_file_info(selector)
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)

    def read_json(self, rel: str) -> Any:
        """Parsed JSON content of ``rel``."""
        return json.loads(self.read_bytes(rel))

    def write_json(self, rel: str, obj: Any) -> None:
        """Write ``obj`` as JSON to ``rel``, atomically (see ``write_bytes``)."""
        self.write_bytes(rel, json.dumps(obj, indent=1, sort_keys=True).encode())

    # Checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self, run_id: str, epoch: int, data: bytes) -> str:
        """Store the checkpoint of ``epoch`` (0-based) of ``run_id``; return its relative path."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"checkpoint epoch must be an int >= 0, got {epoch!r}")
        rel = posixpath.join(self.checkpoints_path(run_id), f"epoch-{epoch:06d}.ckpt")
        self.write_bytes(rel, data)
        return rel

    def list_checkpoints(self, run_id: str) -> list[int]:
        """Epochs that have a complete checkpoint in run ``run_id``, ascending."""
        names = self.list_files(self.checkpoints_path(run_id))
        return sorted(int(m.group(1)) for m in map(_CHECKPOINT_RE.match, names) if m)

    def latest_checkpoint(self, run_id: str) -> tuple[int, bytes] | None:
        """``(epoch, bytes)`` of the newest checkpoint of ``run_id``, or None if there is none."""
        epochs = self.list_checkpoints(run_id)
        if not epochs:
            return None
        rel = posixpath.join(self.checkpoints_path(run_id), f"epoch-{epochs[-1]:06d}.ckpt")
        return epochs[-1], self.read_bytes(rel)


class LocalStore(Store):
    """A store on the local (or a mounted shared) filesystem."""

    def __init__(self, prefix: str) -> None:
        if not isinstance(prefix, str) or not _is_local(prefix):
            raise ConfigError(f"LocalStore needs a local path or file:// URL, got {prefix!r}")
        super().__init__(prefix)


class HDFSStore(Store):
    """A store on HDFS (``hdfs://namenode:port/path``); needs libhdfs where it is used."""

    def __init__(self, prefix: str) -> None:
        if not isinstance(prefix, str) or not prefix.startswith("hdfs://"):
            raise ConfigError(f"HDFSStore needs an hdfs:// URL, got {prefix!r}")
        super().__init__(prefix)


class DBFSLocalStore(LocalStore):
    """A Databricks DBFS store read through its local FUSE mount: ``dbfs:/x`` -> ``/dbfs/x``."""

    def __init__(self, prefix: str) -> None:
        if isinstance(prefix, str) and prefix.startswith("dbfs:"):
            prefix = "/dbfs/" + prefix[len("dbfs:"):].lstrip("/")
        super().__init__(prefix)


def _checked_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name in (".", ".."):
        raise ConfigError(
            f"{what} must be a non-empty name of letters, digits and ._=+- (no '/'), got {name!r}"
        )
    return name


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    try:
        fs.delete_file(path)
    except OSError:
        pass  # the temp file may never have been created
