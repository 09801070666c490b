"""Saving and loading estimators and models: Spark ML metadata plus opaque files.

``save(path)`` writes Spark's ``metadata`` (class, uid, JSON-able params) and a
``data/`` folder holding the rest: the cloudpickled Python-object params and, for
models, the trained model's bytes and history. Paths go through pyarrow's
filesystems, so they may be local, HDFS, S3, ...
"""

from __future__ import annotations

import importlib
import json
import posixpath
from typing import Any

import cloudpickle
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from hvd_spark.data.store import filesystem_from_url


def _write_file(url: str, data: bytes) -> None:
    fs, path = filesystem_from_url(url)
    fs.create_dir(posixpath.dirname(path), recursive=True)
    with fs.open_output_stream(path) as out:
        out.write(data)


def _read_file(url: str) -> bytes:
    fs, path = filesystem_from_url(url)
    with fs.open_input_stream(path) as src:
        return src.read()


def json_params(instance: Any) -> dict[str, Any]:
    """The instance's explicitly set params whose values are JSON-able."""
    out = {}
    for param, value in instance._paramMap.items():
        try:
            json.dumps(value)
        except TypeError:
            continue
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

    def saveImpl(self, path: str) -> None:  # noqa: N802 - Spark's API name
        DefaultParamsWriter.saveMetadata(
            self.instance, path, self.sparkSession, paramMap=json_params(self.instance)
        )
        _write_file(posixpath.join(path, "data", "params.pkl"),
                    cloudpickle.dumps(object_params(self.instance)))
        for name, blob in self.instance._persisted_blobs().items():
            _write_file(posixpath.join(path, "data", name), blob)


class PickledReader(MLReader):
    """Reads what PickledWriter wrote, into an instance of the class named in the metadata."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        module, _, name = metadata["class"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        instance = cls.__new__(cls)
        instance._init_empty()
        instance._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(instance, metadata)
        objects = cloudpickle.loads(_read_file(posixpath.join(path, "data", "params.pkl")))
        instance._set(**objects)
        blobs = {name: _read_file(posixpath.join(path, "data", name))
                 for name in instance._blob_names()}
        instance._restore_blobs(blobs)
        return instance
