"""Spark ML Params of the estimators and models, named as Horovod names them.

Param names are Horovod's snake_case (``est.batch_size``, ``est.getOrDefault("batch_size")``,
``ParamGridBuilder().addGrid(est.batch_size, [...])``); each has ``setX``/``getX``
accessors (``setBatchSize``/``getBatchSize``), plus Horovod's irregular accessor names
where it has them (``getShufflingBufferSize``, ``setInMemoryCacheAll``, ...).
Constructors are keyword-only with explicit signatures (``help(TorchEstimator)``
lists every parameter); an unknown keyword is a ConfigError that lists the known ones.

Parameters that only make sense for Horovod's petastorm/NVTabular readers are accepted
and ignored with one log line each, so that Horovod scripts run unchanged.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from pyspark.ml.param import Param, Params, TypeConverters

from hvd_spark.errors import ConfigError

log = logging.getLogger("hvd_spark.estimator")

_ANY = None  # Python objects (models, optimizers, stores) are kept as they are.
_INT, _BOOL, _STR = TypeConverters.toInt, TypeConverters.toBoolean, TypeConverters.toString
_STRS, _FLOATS = TypeConverters.toListString, TypeConverters.toListFloat

# (Param name, doc, converter, default). Defaults are Horovod's unless said otherwise.
SHARED_PARAMS: list[tuple[str, str, Any, Any]] = [
    ("num_proc", "number of ranks (default: the cluster's task slots); not with backend",
     _INT, None),
    ("backend", "a Backend (SparkBackend, or LauncherBackend over any Launcher) that runs "
                "the training; not with num_proc", _ANY, None),
    ("store", "Store (or path/URL) for data, checkpoints and logs", _ANY, None),
    ("model", "the model to train (framework object)", _ANY, None),
    ("optimizer", "the optimizer (framework object)", _ANY, None),
    ("loss", "loss function, or one per label column", _ANY, None),
    ("loss_weights", "weight of each label column's loss (torch default: 1/len(label_cols))",
     _FLOATS, None),
    ("metrics", "metrics to report per epoch", _ANY, None),
    ("feature_cols", "feature column names, in the model's input order", _STRS, None),
    ("label_cols", "label column names, one per model output", _STRS, None),
    ("continuous_cols", "NVTabular's continuous columns (ignored here)", _STRS, None),
    ("categorical_cols", "NVTabular's categorical columns (ignored here)", _STRS, None),
    ("sample_weight_col", "column of per-row loss weights", _STR, None),
    ("validation", "fraction of rows in [0, 1) or name of a 0/1/bool column", _ANY, None),
    ("callbacks", "framework callbacks run during training", _ANY, None),
    ("batch_size", "rows per batch on each rank", _INT, 32),
    ("val_batch_size", "rows per validation batch (default: batch_size)", _INT, None),
    ("epochs", "number of epochs", _INT, 1),
    ("verbose", "0: quiet, 1: a line per epoch on the driver", _INT, 1),
    ("random_seed", "seed of the framework, the shuffling and the split (None: data seed 0, "
     "framework unseeded)", _INT, None),
    ("shuffle_buffer_size", "rows mixed in each rank's shuffle buffer (default: up to 10,000 "
     "rows / 256 MiB)", _INT, None),
    ("shuffle", "shuffle rows every epoch", _BOOL, True),
    ("partitions_per_process", "Parquet files written per rank (hvd_spark default: 4)", _INT, 4),
    ("run_id", "run id; a second fit with the same id resumes from its checkpoint", _STR, None),
    ("train_steps_per_epoch", "training batches per epoch (default: all rows)", _INT, None),
    ("validation_steps_per_epoch", "validation batches per epoch (default: all rows)",
     _INT, None),
    ("transformation_fn", "function(batch dict of numpy arrays) -> batch, applied to every "
     "batch before training and validation", _ANY, None),
    ("transformation_edit_fields", "petastorm TransformSpec fields (ignored here)", _ANY, None),
    ("transformation_removed_fields", "petastorm TransformSpec fields (ignored here)",
     _ANY, None),
    ("train_reader_num_workers", "threads decoding training data on each rank", _INT, None),
    ("val_reader_num_workers", "threads decoding validation data on each rank", _INT, None),
    ("reader_pool_type", "petastorm's worker pool type (ignored here)", _STR, "thread"),
    ("label_shapes", "per-row shape of each label column (a leading -1 batch dimension "
     "allowed)", _ANY, None),
    ("inmemory_cache_all", "keep each rank's decoded rows in memory after the first epoch",
     _BOOL, False),
    ("use_gpu", "train on the rank's GPU when there is one (CPU otherwise)", _BOOL, True),
    ("mp_start_method", "multiprocessing start method set in each rank", _STR, None),
    ("backward_passes_per_step", "batches accumulated before each allreduce", _INT, 1),
    ("gradient_compression", "Compression.none or Compression.fp16", _ANY, None),
    ("compress_sparse_cols", "petastorm's sparse-vector compression (ignored here)",
     _BOOL, False),
    ("tensorflow_dataset_prefetch_buffer_size", "tf.data prefetch (ignored here)", _INT, 0),
    ("data_module", "Horovod's data-module class (ignored here)", _ANY, None),
    ("output_cols", "prediction column names (default: <label>__output); hvd_spark only",
     _STRS, None),
    ("max_retries", "times a fit resumes from its last checkpoint after losing a rank's "
     "process or executor (0: never); hvd_spark only", _INT, 3),
    ("checkpoint_every_steps", "also checkpoint every N training steps, so a retry loses "
     "less than an epoch (TorchEstimator; default: per epoch only); hvd_spark only",
     _INT, None),
    ("mlflow", "track the fit in MLflow: True, False, or None (default: when a run is active "
     "or autolog is on); hvd_spark only", _ANY, None),
]

#: Params accepted for Horovod compatibility that do nothing here, with the reason.
IGNORED: dict[str, str] = {
    "reader_pool_type": "hvd_spark reads Parquet with pyarrow in decode threads, not petastorm "
                        "worker pools",
    "compress_sparse_cols": "sparse vectors are stored dense in a packed binary layout",
    "continuous_cols": "they only select columns for NVTabular's data module",
    "categorical_cols": "they only select columns for NVTabular's data module",
    "transformation_edit_fields": "batches are dicts of numpy arrays: transformation_fn may "
                                  "add or change fields without declaring them",
    "transformation_removed_fields": "batches are dicts of numpy arrays: transformation_fn may "
                                     "drop fields without declaring them",
    "tensorflow_dataset_prefetch_buffer_size": "the reader prefetches batches in its own thread",
    "data_module": "every Estimator reads through hvd_spark's one sharded Parquet reader",
}

#: Horovod's accessor names that do not follow from the Param name.
ACCESSOR_ALIASES = {
    "shuffle_buffer_size": "ShufflingBufferSize",
    "train_reader_num_workers": "TrainReaderNumWorker",
    "val_reader_num_workers": "ValReaderNumWorker",
    "inmemory_cache_all": "InMemoryCacheAll",
}


def camel(name: str) -> str:
    """``batch_size`` -> ``BatchSize`` (``outputCols`` -> ``OutputCols``)."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_") if part)


def define_params(cls: type, specs: list[tuple[str, str, Any, Any]]) -> type:
    """Attach each Param and its ``setX``/``getX`` accessors to ``cls``."""
    for name, doc, converter, default in specs:
        param = Param(Params._dummy(), name, doc, typeConverter=converter)
        # The API reference and help() read __doc__: each Param's own description, not
        # pyspark's class docstring (an instance attribute wins; Params' copies keep it).
        param.__doc__ = f"{doc[:1].upper()}{doc[1:]}." + (
            "" if default is None else f" Default: {default!r}.")
        setattr(cls, name, param)

        def setter(self, value, _name=name):
            return self._set(**{_name: value})

        def getter(self, _name=name):
            return self.getOrDefault(getattr(self, _name))

        for suffix in {camel(name), ACCESSOR_ALIASES.get(name, camel(name))}:
            setter.__doc__ = f"Set {name}: {doc}."
            getter.__doc__ = f"Get {name}: {doc}."
            if f"set{suffix}" not in cls.__dict__:
                setattr(cls, f"set{suffix}", setter)
            if f"get{suffix}" not in cls.__dict__:
                setattr(cls, f"get{suffix}", getter)
    return cls


def keyword_only_params(init: Callable) -> Callable:
    """Like pyspark's ``keyword_only``, but an unknown keyword is a ConfigError listing
    the known ones (the wrapped signature stays visible to ``help`` and ``inspect``)."""
    names = [p for p in inspect.signature(init).parameters if p != "self"]

    @functools.wraps(init)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise ConfigError(f"{type(self).__name__} takes keyword arguments only "
                              f"(got {len(args)} positional)")
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ConfigError(f"{type(self).__name__} got unknown parameter(s) {unknown}; "
                              f"known: {sorted(names)}")
        self._input_kwargs = kwargs
        return init(self, **kwargs)

    return wrapper


class KeywordParams(Params):
    """Params set from snake_case keywords, with defaults from the class's spec list."""

    _param_specs: list[tuple[str, str, Any, Any]] = []

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(**{name: default for name, _, _, default in self._param_specs})

    def setParams(self, **kwargs: Any) -> Any:  # noqa: N802 - Spark ML naming
        """Set Params by name; an unknown name is a ConfigError, None keeps the default.

        A Horovod parameter that does nothing here is set (so ``getX`` returns it) and
        logged once, with the reason.
        """
        known = {name for name, *_ in self._param_specs}
        unknown = sorted(k for k in kwargs if k not in known)
        if unknown:
            raise ConfigError(
                f"{type(self).__name__} got unknown parameter(s) {unknown}; "
                f"known: {sorted(known)}"
            )
        values = {k: v for k, v in kwargs.items() if v is not None}
        defaults = {name: default for name, _, _, default in self._param_specs}
        ignored = self._ignored()
        for name, value in values.items():
            if name in ignored and value != defaults.get(name):
                log.info("%s: %s=%r is accepted for Horovod compatibility and ignored: %s",
                         type(self).__name__, name, value, ignored[name])
        return self._set(**values)

    def _ignored(self) -> dict[str, str]:
        """Params that do nothing for this class -> why (logged when set)."""
        return dict(IGNORED)

    def value(self, name: str) -> Any:
        """The Param's value (set or default) by its name."""
        return self.getOrDefault(getattr(self, name))
