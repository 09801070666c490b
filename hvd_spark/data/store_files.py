"""The file operations of a Store: atomic writes, reads, Parquet checks, checkpoints, sync.

A mixin of ``hvd_spark.data.store.Store``: every method takes a path relative to the
store's prefix or a full path/URL on its filesystem, and resolves it with ``self.path``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq
from pyarrow import fs as pafs

from hvd_spark.errors import ConfigError

if TYPE_CHECKING:
    from pyarrow import dataset as pads

log = logging.getLogger(__name__)

_CHECKPOINT_RE = re.compile(r"^epoch-(\d+)\.ckpt$")
_TEMP_MARK = ".tmp-"
# Filesystems where a rename is cheap and atomic; object stores publish a PUT atomically.
_RENAME_ATOMIC = {"local", "hdfs"}


class StoreFiles:
    """File operations on top of ``filesystem``, ``path`` and the run layout of a Store."""

    filesystem: pafs.FileSystem
    _save_runs: bool

    if TYPE_CHECKING:
        def path(self, *parts: str) -> str: ...
        def checkpoints_path(self, run_id: str) -> str: ...
        def get_run_path(self, run_id: str) -> str: ...
        def get_train_data_path(self, idx: int | None = None) -> str: ...
        def get_val_data_path(self, idx: int | None = None) -> str: ...
        def get_test_data_path(self, idx: int | None = None) -> str: ...
        def get_runs_path(self) -> str: ...
        def get_checkpoint_path(self, run_id: str) -> str | None: ...
        def get_logs_path(self, run_id: str) -> str | None: ...
        def get_checkpoint_filename(self) -> str: ...
        def get_logs_subdir(self) -> str: ...

    def exists(self, path: str) -> bool:
        """Whether a file or directory exists at ``path``."""
        return self.filesystem.get_file_info(self.path(path)).type != pafs.FileType.NotFound

    def read(self, path: str) -> bytes:
        """Contents of the file at ``path`` (Horovod's name for ``read_bytes``)."""
        return self.read_bytes(path)

    def read_bytes(self, path: str) -> bytes:
        """Contents of the file at ``path``; FileNotFoundError if it is missing."""
        with self.filesystem.open_input_stream(self.path(path)) as stream:
            return stream.read()

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` so that readers never see a partial file.

        On local and HDFS filesystems the data goes to a temporary name first and is
        renamed into place; object stores (S3, GCS) publish an upload atomically anyway.
        """
        fs = self.filesystem
        target = self.path(path)
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

    def write_text(self, path: str, text: str) -> None:
        """Write ``text`` (UTF-8) to ``path``, atomically (see ``write_bytes``)."""
        self.write_bytes(path, text.encode("utf-8"))

    def delete(self, path: str) -> None:
        """Delete the file or directory tree at ``path`` (no error if it is missing)."""
        fs = self.filesystem
        target = self.path(path)
        info = fs.get_file_info(target)
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(target)
        elif info.type != pafs.FileType.NotFound:
            fs.delete_file(target)

    def list_files(self, path: str) -> list[str]:
        """Names of the files directly under directory ``path`` (empty if it is missing)."""
        selector = pafs.FileSelector(self.path(path), allow_not_found=True)
        infos = self.filesystem.get_file_info(selector)
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)

    def read_json(self, path: str) -> Any:
        """Parsed JSON content of ``path``."""
        return json.loads(self.read_bytes(path))

    def write_json(self, path: str, obj: Any) -> None:
        """Write ``obj`` as JSON to ``path``, atomically (see ``write_bytes``)."""
        self.write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode())

    # Parquet --------------------------------------------------------------------------

    def get_parquet_dataset(self, path: str) -> pads.Dataset:
        """The Parquet dataset at ``path`` (a directory or one file), as a ``pyarrow.dataset``.

        Files whose names start with ``_`` or ``.`` (markers, metadata) are skipped, as
        Spark and pyarrow skip them.
        """
        from pyarrow import dataset as pads

        return pads.dataset(self.path(path), filesystem=self.filesystem, format="parquet")

    def is_parquet_dataset(self, path: str) -> bool:
        """Whether ``path`` is a readable Parquet dataset with at least one file."""
        try:
            dataset = self.get_parquet_dataset(path)
            if not dataset.files:
                return False
            pq.read_metadata(dataset.files[0], filesystem=self.filesystem)
        except (OSError, ValueError, ConfigError):  # pyarrow's ArrowInvalid is a ValueError
            return False
        return True

    # Checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self, run_id: str, epoch: int, data: bytes) -> str | None:
        """Store the checkpoint of ``epoch`` (0-based) of ``run_id``; return its path.

        Returns None and writes nothing when the store was made with ``save_runs=False``.
        """
        if not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"checkpoint epoch must be an int >= 0, got {epoch!r}")
        if not self._save_runs:
            return None
        path = posixpath.join(self.checkpoints_path(run_id), f"epoch-{epoch:06d}.ckpt")
        self.write_bytes(path, data)
        return path

    def list_checkpoints(self, run_id: str) -> list[int]:
        """Epochs that have a complete checkpoint in run ``run_id``, ascending."""
        names = self.list_files(self.checkpoints_path(run_id))
        return sorted(int(m.group(1)) for m in map(_CHECKPOINT_RE.match, names) if m)

    def latest_checkpoint(self, run_id: str) -> tuple[int, bytes] | None:
        """``(epoch, bytes)`` of the newest checkpoint of ``run_id``, or None if there is none."""
        epochs = self.list_checkpoints(run_id)
        if not epochs:
            return None
        path = posixpath.join(self.checkpoints_path(run_id), f"epoch-{epochs[-1]:06d}.ckpt")
        return epochs[-1], self.read_bytes(path)

    # Run output -----------------------------------------------------------------------

    def get_local_output_dir_fn(self, run_id: str) -> Callable[[], Any]:
        """A context-manager factory yielding a temporary local directory for run output."""
        return _temporary_dir

    def sync_fn(self, run_id: str) -> Callable[[str], None]:
        """A function copying a local directory tree into the run path of ``run_id``.

        Each call uploads the files that are new or modified since the previous call of
        the same function (by modification time), so it can run after every epoch. It
        pickles, and re-creates the filesystem in the process that calls it.
        """
        return _Syncer(self, self.get_run_path(run_id))

    def upload_dir(self, local: str, path: str) -> None:
        """Upload every file under the local directory ``local`` to ``path``, keeping the tree.

        Nothing happens when ``local`` does not exist (a run that wrote no logs). The
        Estimators' workers upload their TensorBoard logs this way.
        """
        if os.path.isdir(local):
            _Syncer(self, path)(local)

    def copy(self, lpath: str, rpath: str, recursive: bool = False) -> None:
        """Upload local file ``lpath`` to ``rpath``, or (``recursive``) a directory's contents.

        As Horovod's ``FilesystemStore.copy``: the files inside ``lpath`` land directly under
        ``rpath``, also when ``rpath`` exists already.
        """
        if os.path.isdir(lpath):
            if not recursive:
                raise ConfigError(f"{lpath!r} is a directory: pass recursive=True to copy it")
            _Syncer(self, rpath)(lpath)
        elif os.path.isfile(lpath):
            with open(lpath, "rb") as src:
                self.write_bytes(rpath, src.read())
        else:
            raise ConfigError(f"copy needs an existing local file or directory, got {lpath!r}")

    def to_remote(self, run_id: str, dataset_idx: int | None) -> SimpleNamespace:
        """A plain view of the paths and functions of ``run_id`` (Horovod's RemoteStore)."""
        return SimpleNamespace(
            train_data_path=self.get_train_data_path(dataset_idx),
            val_data_path=self.get_val_data_path(dataset_idx),
            test_data_path=self.get_test_data_path(dataset_idx),
            saving_runs=self._save_runs,
            runs_path=self.get_runs_path(),
            run_path=self.get_run_path(run_id),
            checkpoint_path=self.get_checkpoint_path(run_id),
            logs_path=self.get_logs_path(run_id),
            checkpoint_filename=self.get_checkpoint_filename(),
            logs_subdir=self.get_logs_subdir(),
            get_local_output_dir=self.get_local_output_dir_fn(run_id),
            sync=self.sync_fn(run_id),
        )


@contextlib.contextmanager
def _temporary_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="hvd_spark_run_") as path:
        yield path


class _Syncer:
    """``sync_fn``'s function: uploads new or changed local files under a run path."""

    def __init__(self, store: StoreFiles, run_path: str) -> None:
        self.store = store
        self.run_path = run_path
        self._uploaded: dict[str, int] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"store": self.store, "run_path": self.run_path, "_uploaded": dict(self._uploaded)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __call__(self, local_run_path: str) -> None:
        if not os.path.isdir(local_run_path):
            raise ConfigError(f"sync needs a local directory, got {local_run_path!r}")
        with self._lock:
            for root, _, files in os.walk(local_run_path):
                rel_dir = os.path.relpath(root, local_run_path)
                for name in files:
                    local = os.path.join(root, name)
                    stamp = os.stat(local).st_mtime_ns
                    if self._uploaded.get(local) == stamp:
                        continue
                    rel = name if rel_dir == "." else posixpath.join(
                        rel_dir.replace(os.sep, "/"), name)
                    with open(local, "rb") as src:
                        self.store.write_bytes(posixpath.join(self.run_path, rel), src.read())
                    self._uploaded[local] = stamp


def _delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    try:
        fs.delete_file(path)
    except OSError:
        pass  # the temp file may never have been created
