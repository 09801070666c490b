"""Saving and loading estimators and models: Spark ML metadata plus opaque files.

``save(path)`` writes Spark's ``metadata`` (class, uid, JSON-able params, in the text
layout Spark's ``DefaultParamsWriter`` uses) and a ``data/`` folder holding the rest:
the cloudpickled Python-object params and, for models, the trained model's bytes and
history. Everything goes through one pyarrow filesystem (local, ``dbfs:/``, HDFS,
``s3://``/``s3a://``, ...), never half through Hadoop, and the metadata is written last
so that an interrupted save never looks like a saved model.
"""

from __future__ import annotations

import importlib
import json
import posixpath
import weakref
from typing import Any

import cloudpickle
from pyarrow import fs as pafs
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from hvd_spark.data.filesystems import filesystem_from_url, join_url
from hvd_spark.errors import ConfigError

_METADATA_FILE = "part-00000"

#: Instances PickledReader loaded, by uid (weakly): a validator's saved param-map values
#: rebind the loaded stages' object Params (``param_map_io``).
LOADED: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def write_file(url: str, data: bytes) -> None:
    """Write ``data`` to ``url`` (any filesystem pyarrow knows), making its folder."""
    fs, path = filesystem_from_url(url)
    fs.create_dir(posixpath.dirname(path), recursive=True)
    with fs.open_output_stream(path) as out:
        out.write(data)


def read_file(url: str) -> bytes:
    """The bytes at ``url`` (any filesystem pyarrow knows)."""
    fs, path = filesystem_from_url(url)
    with fs.open_input_stream(path) as src:
        return src.read()


def read_metadata(url: str) -> str:
    """The JSON line of ``<url>/metadata`` (ours, or a part file Spark wrote)."""
    fs, path = filesystem_from_url(join_url(url, "metadata"))
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    parts = sorted(i.path for i in infos if i.type == pafs.FileType.File
                   and not i.base_name.startswith(("_", ".")))
    if not parts:
        raise ConfigError(f"{url!r} holds no saved estimator or model (no metadata/); "
                          "check the path")
    with fs.open_input_stream(parts[0]) as src:
        return src.read().decode("utf-8").splitlines()[0]


def json_params(instance: Any) -> dict[str, Any]:
    """The instance's explicitly set params whose values JSON holds as they are (a tuple,
    or a dict with int keys, would come back changed: those are pickled)."""
    out = {}
    for param, value in instance._paramMap.items():
        try:
            back = json.loads(json.dumps(value))
        except (TypeError, ValueError):
            continue
        if back == value and type(back) is type(value):
            out[param.name] = value
    return out


def object_params(instance: Any) -> dict[str, Any]:
    """The instance's explicitly set params whose values are Python objects."""
    keep = json_params(instance)
    return {p.name: v for p, v in instance._paramMap.items() if p.name not in keep}


class PickledWriter(MLWriter):
    """Writes metadata + ``data/params.pkl`` + ``data/<name>`` blobs."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def save(self, path: str) -> None:
        """Save to ``path``; an existing path is replaced only after ``overwrite()``."""
        if not isinstance(path, str) or not path:
            raise ConfigError(f"save path must be a non-empty path or URL, got {path!r}")
        fs, target = filesystem_from_url(path)
        if fs.get_file_info(target).type != pafs.FileType.NotFound:
            if not self.shouldOverwrite:
                raise ConfigError(f"{path!r} already exists: use write().overwrite().save(path) "
                                  "to replace it, or another path")
            if fs.get_file_info(target).type == pafs.FileType.Directory:
                fs.delete_dir(target)
            else:
                fs.delete_file(target)
        self.saveImpl(path)

    def saveImpl(self, path: str) -> None:  # noqa: N802 - Spark's API name
        write_file(join_url(path, "data", "params.pkl"), _pickled_params(self.instance))
        for name, blob in self.instance._persisted_blobs().items():
            write_file(join_url(path, "data", name), blob)
        metadata = DefaultParamsWriter._get_metadata_to_save(
            self.instance, self.sparkSession, paramMap=json_params(self.instance))
        write_file(join_url(path, "metadata", _METADATA_FILE), (metadata + "\n").encode())
        write_file(join_url(path, "metadata", "_SUCCESS"), b"")


class PickledReader(MLReader):
    """Reads what PickledWriter wrote, into an instance of the class named in the metadata."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        return load_saved(path)


def load_saved(path: str) -> Any:
    """The Estimator or Model saved at ``path``, of the class its metadata names.

    What ``TorchModel.load(path)`` (or any saved class's ``load``) returns, for callers
    that do not know the class (the MLflow pyfunc wrapper).
    """
    metadata = DefaultParamsReader._parseMetaData(read_metadata(path))
    module, _, name = metadata["class"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    instance = cls.__new__(cls)
    instance._init_empty()
    instance._resetUid(metadata["uid"])
    DefaultParamsReader.getAndSetParams(instance, metadata)
    objects = cloudpickle.loads(read_file(join_url(path, "data", "params.pkl")))
    instance._set(**objects)
    blobs = {name: read_file(join_url(path, "data", name))
             for name in instance._blob_names()}
    instance._restore_blobs(blobs)
    LOADED[instance.uid] = instance
    return instance


def _pickled_params(instance: Any) -> bytes:
    """The object params, in one pickle (shared objects stay shared); a ConfigError names
    the param that cannot be pickled."""
    objects = object_params(instance)
    try:
        return cloudpickle.dumps(objects)
    except Exception as exc:  # noqa: BLE001 - find which param cannot be pickled
        for name, value in objects.items():
            try:
                cloudpickle.dumps(value)
            except Exception:  # noqa: BLE001 - this one
                raise ConfigError(
                    f"cannot save {type(instance).__name__}: its {name} value cannot be "
                    f"pickled ({type(exc).__name__}: {exc}); clear it (clear(obj.{name})) "
                    "or make it picklable") from exc
        raise
