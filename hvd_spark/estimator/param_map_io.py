"""Saving and loading Spark ML validators whose param maps hold Python objects.

``CrossValidator`` / ``TrainValidationSplit`` and their models write every value of
``estimatorParamMaps`` as JSON, unless it is an Estimator, Transformer or Evaluator,
which Spark saves in a folder beside the metadata and loads with its class's ``load``.
A grid over optimizer objects, loss functions or models therefore fitted, then failed to
save: "Object of type Adam is not JSON serializable".

``install`` (on import of the Estimators) wraps Spark's shared validator writer: the
values JSON cannot hold are written in one cloudpickle file, ``hvd_spark_param_values.pkl``
in the save's folder, with the object Params of the hvd_spark stages, and each is replaced
in the written param maps by a ``PickledParamValue`` (a Transformer, so Spark saves it
beside the metadata). Loading needs nothing installed: Spark calls
``PickledParamValue.load``, which returns the value itself, and sets the loaded hvd_spark
stages' object Params from the same pickle. One pickle keeps Python's object identity: an
optimizer of a param map is still over the loaded estimator's model's parameters, and the
loaded ``CrossValidator`` fits again.
"""

from __future__ import annotations

import copy
import json
import posixpath
import threading
from typing import Any

import cloudpickle
from pyarrow import fs as pafs
from pyspark.ml.base import Estimator, Transformer
from pyspark.ml.evaluation import Evaluator
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import DefaultParamsReader, MLWritable

from hvd_spark.data.filesystems import filesystem_from_url, join_url
from hvd_spark.errors import ConfigError
from hvd_spark.estimator import persistence
from hvd_spark.estimator.params import KeywordParams

VALUES_FILE = "hvd_spark_param_values.pkl"
_MARK = "_hvd_spark_wrapped"

_CACHE: dict[str, tuple[tuple, dict]] = {}
_LOCK = threading.Lock()


class PickledParamValue(Transformer, MLWritable):
    """Stands for a param-map value in a saved validator; ``load`` returns the value."""

    slot = Param(Params._dummy(), "slot", "index of the value in the save's pickle",
                 typeConverter=TypeConverters.toInt)
    stages = Param(Params._dummy(), "stages", "uids of the hvd_spark stages in the pickle",
                   typeConverter=TypeConverters.toListString)

    def __init__(self, slot: int = 0, stages: list[str] | None = None) -> None:
        super().__init__()
        self._set(slot=slot, stages=list(stages or []))

    def _transform(self, dataset: Any) -> Any:
        raise ConfigError("PickledParamValue only stands for a saved param-map value")

    def write(self) -> persistence.PickledWriter:
        return persistence.PickledWriter(self)

    def _persisted_blobs(self) -> dict[str, bytes]:
        return {}

    @classmethod
    def load(cls, path: str) -> Any:
        """The value saved at ``path`` (not a PickledParamValue)."""
        metadata = DefaultParamsReader._parseMetaData(persistence.read_metadata(path))
        folder = posixpath.dirname(path.rstrip("/"))
        params = metadata["paramMap"]
        return _saved(folder, params.get("stages", []))["values"][params["slot"]]


def _saved(folder: str, uids: list[str]) -> dict:
    """The save's pickle, unpickled once per load: the values share their objects, and
    the loaded stages get the pickle's copies of their object Params."""
    url = join_url(folder, VALUES_FILE)
    fs, path = filesystem_from_url(url)
    info = fs.get_file_info(path)
    if info.type != pafs.FileType.File:
        raise ConfigError(f"{folder!r}: {VALUES_FILE} is missing; the param maps' Python "
                          "values were saved there (save the validator again)")
    # Spark loads the estimator before the param maps: its stages are the latest loaded.
    stages = {uid: persistence.LOADED.get(uid) for uid in uids}
    # Unpickled again for another load (other stage objects) or another save (file).
    key = (info.size, info.mtime_ns, tuple(id(s) for s in stages.values()))
    with _LOCK:
        cached = _CACHE.get(url)
        if cached is not None and cached[0] == key:
            return cached[1]
        saved = cloudpickle.loads(persistence.read_file(url))
        for uid, stage in stages.items():
            if stage is not None:
                stage._set(**saved["stages"].get(uid, {}))
        _CACHE[url] = (key, saved)
        return saved


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _stage_objects(instance: Any) -> dict[str, dict]:
    """The object Params each hvd_spark stage of the validator's estimator saves."""
    from pyspark.ml.util import MetaAlgorithmReadWrite

    out = {}
    for uid, stage in MetaAlgorithmReadWrite.getUidMap(instance.getEstimator()).items():
        if isinstance(stage, KeywordParams):
            unsaved = getattr(stage, "_unsaved_params", ())
            out[uid] = {k: v for k, v in persistence.object_params(stage).items()
                        if k not in unsaved}
    return out


def _wrap(path: str, instance: Any) -> Any:
    """``instance``, or a copy whose param maps hold PickledParamValues, their values
    written to ``path``/``VALUES_FILE`` first."""
    values: list[Any] = []
    names: list[str] = []
    wrapped = []
    stages = _stage_objects(instance)
    for param_map in instance.getEstimatorParamMaps():
        out = {}
        for param, value in param_map.items():
            native = isinstance(value, (Estimator, Transformer, Evaluator, MLWritable))
            if native or _is_json(value):
                out[param] = value  # Spark saves these itself
            else:
                out[param] = PickledParamValue(len(values), sorted(stages))
                values.append(value)
                names.append(param.name)
        wrapped.append(out)
    if not values:
        return instance
    saved = {"values": values, "stages": stages}
    try:
        blob = cloudpickle.dumps(saved)  # one pickle: the objects keep their identity
    except Exception as exc:  # noqa: BLE001 - find which value cannot be pickled
        culprit = next((n for n, v in zip(names, values) if not _picklable(v)), "a stage's")
        raise ConfigError(f"cannot save the param maps: the {culprit} value cannot be "
                          f"pickled ({type(exc).__name__}: {exc})") from exc
    persistence.write_file(join_url(path, VALUES_FILE), blob)
    proxy = copy.copy(instance)
    proxy._paramMap = {**instance._paramMap, instance.getParam("estimatorParamMaps"): wrapped}
    return proxy


def _picklable(value: Any) -> bool:
    try:
        cloudpickle.dumps(value)
    except Exception:  # noqa: BLE001 - any failure means no
        return False
    return True


def install() -> None:
    """Wrap Spark's validator writer (once): see the module doc."""
    try:
        from pyspark.ml.tuning import _ValidatorSharedReadWrite as shared
    except ImportError:  # another pyspark layout: validators save as Spark does
        return
    original = shared.__dict__.get("saveImpl")
    if original is None or getattr(original, _MARK, False):
        return
    original = original.__func__ if isinstance(original, staticmethod) else original

    def save_impl(path: str, instance: Any, *args: Any, **kwargs: Any) -> Any:
        return original(path, _wrap(path, instance), *args, **kwargs)

    setattr(save_impl, _MARK, True)
    save_impl.__doc__ = original.__doc__
    shared.saveImpl = staticmethod(save_impl)
