"""LightningEstimator / LightningModel: fit a PyTorch Lightning 2.x ``LightningModule`` on a
DataFrame, each rank a Lightning ``Trainer`` over hvd_spark (``lightning_strategy``).

Horovod's ``horovod.spark.lightning`` calls them ``TorchEstimator`` / ``TorchModel``; this
module has those names too, so ``import horovod.spark.lightning as hvd`` ports as
``import hvd_spark.estimator.lightning as hvd``. Lightning is imported only inside
functions: the driver needs it only to build the estimator around a LightningModule.
"""

from __future__ import annotations

from typing import Any

import cloudpickle

from hvd_spark.errors import ConfigError
from hvd_spark.estimator import dry_run
from hvd_spark.estimator import torch as torch_adapter
from hvd_spark.estimator.base import MODEL_PARAMS, HvdEstimator, HvdModel, define
from hvd_spark.estimator.lightning_strategy import lightning_package
from hvd_spark.estimator.lightning_worker import train_lightning
from hvd_spark.estimator.params import keyword_only_params
from hvd_spark.estimator.torch_worker import torch_predictor
from hvd_spark.estimator.tuning import carried_params

#: The oldest Lightning release this estimator supports (the ``lightning>=2.2`` extra), as
#: Horovod's ``horovod.spark.lightning.estimator.MIN_PL_VERSION`` names its own: a string for
#: ``packaging.version.parse``, so ported scripts' version checks keep working.
MIN_PL_VERSION = "2.2.0"

LIGHTNING_PARAMS = [
    ("input_shapes", "shape of each feature input, Horovod's [-1, ...] or one row's", None,
     None),
    ("loss_constructors", "Horovod's legacy (non-Lightning) models only (ignored here)", None,
     None),
    ("train_minibatch_fn", "Horovod's legacy (non-Lightning) models only (ignored here)", None,
     None),
    ("num_gpus", "GPUs per rank: 0 for the CPU, 1 (default when there is one)", None, None),
    ("logger", "a Lightning logger (default: CSV logs uploaded to the store)", None, None),
    ("log_every_n_steps", "the Trainer's log_every_n_steps", None, 50),
    ("loader_num_epochs", "petastorm reader epochs (ignored here)", None, None),
    ("terminate_on_nan", "stop with an error when the training loss is NaN or infinite", None,
     False),
    ("profiler", "the Trainer's profiler (e.g. 'simple')", None, None),
    ("trainer_args", "dict of Trainer arguments added to / overriding the estimator's", None,
     None),
    ("debug_data_loader", "petastorm data-loader debugging (ignored here)", None, False),
    ("train_async_data_loader_queue_size", "petastorm async loader queue (ignored here)", None,
     None),
    ("val_async_data_loader_queue_size", "petastorm async loader queue (ignored here)", None,
     None),
    dry_run.PARAM_SPEC,
]

_LIGHTNING_IGNORED = {
    "loss_constructors": "a LightningModule computes its own loss",
    "train_minibatch_fn": "a LightningModule's training_step is the minibatch function",
    "optimizer": "a LightningModule's configure_optimizers makes the optimizer",
    "loss": "a LightningModule computes its own loss",
    "loss_weights": "a LightningModule computes its own loss",
    "metrics": "a LightningModule logs its own metrics (self.log)",
    "loader_num_epochs": "the reader gives exactly one epoch per iteration",
    "debug_data_loader": "the reader is not petastorm's",
    "train_async_data_loader_queue_size": "the reader prefetches batches in its own thread",
    "val_async_data_loader_queue_size": "the reader prefetches batches in its own thread",
}


class LightningModel(HvdModel):
    """A LightningEstimator's trained model; ``transform`` adds ``<label>__output`` columns."""

    def __init__(self) -> None:
        super().__init__()
        self.logged_metrics: dict[str, float] = {}
        self._module: Any = None

    def predictor_factory(self):
        return torch_predictor

    def _set_extra(self, result: dict) -> None:
        self.logged_metrics = dict(result.get("logged_metrics", {}))

    def getModel(self):  # noqa: N802 - Spark ML naming
        """The trained LightningModule (on CPU, in eval mode); the same object every call."""
        if self._module is None:
            self._module = cloudpickle.loads(self.model_bytes)["model"]
        return self._module

    def getOptimizer(self):  # noqa: N802 - Spark ML naming
        """None, as in Horovod: the LightningModule makes its optimizer."""
        return None

    def getHistory(self) -> dict[str, float]:  # noqa: N802 - Spark ML naming
        """Horovod's Lightning history: the Trainer's ``logged_metrics`` at the end, with
        the values the console showed for the last epoch (averaged over the ranks, where
        Lightning's own are rank 0's unless logged with ``sync_dist=True``)."""
        return dict(self.logged_metrics)

    def getEpochHistory(self) -> list[dict]:  # noqa: N802 - Spark ML naming
        """One record per epoch: ``{"epoch": 1, "<metric>": value, ...}`` (averaged over ranks)."""
        return [dict(r) for r in self.records]

    def _persisted_blobs(self) -> dict[str, bytes]:
        import json

        return {**super()._persisted_blobs(),
                "logged.json": json.dumps(self.logged_metrics).encode()}

    def _blob_names(self) -> list[str]:
        return [*super()._blob_names(), "logged.json"]

    def _restore_blobs(self, blobs: dict[str, bytes]) -> None:
        import json

        super()._restore_blobs(blobs)
        self.logged_metrics = json.loads(blobs["logged.json"])

    def _init_empty(self) -> None:
        LightningModel.__init__(self)


class LightningEstimator(torch_adapter.TorchInputShapes, HvdEstimator):
    """Spark ML Estimator training a PyTorch Lightning 2.x ``LightningModule`` on N ranks.

    Parameters are Horovod's ``horovod.spark.lightning.TorchEstimator``'s. Each rank runs
    a ``Trainer`` with hvd_spark's strategy (gradients averaged by the DistributedOptimizer
    around every optimizer ``configure_optimizers`` returns). ``training_step`` gets each
    batch as a dict of column -> tensor (features reshaped to ``input_shapes``). The
    learning rate is used as given (Horovod multiplies it by the number of ranks); there is
    no ``learning_rate`` Param: ``configure_optimizers`` owns the optimizers and their
    schedulers' base rates, so tune the rate as a hyperparameter of the module (a grid over
    ``model``).
    ``callbacks`` are Lightning callbacks; a ``ModelCheckpoint`` among them decides which
    weights the fitted model gets (its best). ``trainer_args`` override the Trainer's
    arguments. A model that is not a LightningModule is a ConfigError: use TorchEstimator.
    """

    _unsaved_params = ("backend", "logger")

    @keyword_only_params
    def __init__(self, num_proc=None, model=None, backend=None, store=None, optimizer=None,
                 loss=None, loss_constructors=None, metrics=None, loss_weights=None,
                 sample_weight_col=None, gradient_compression=None, feature_cols=None,
                 input_shapes=None, validation=None, label_cols=None, callbacks=None,
                 batch_size=None, val_batch_size=None, epochs=None, verbose=1,
                 random_seed=None, shuffle_buffer_size=None, shuffle=True,
                 partitions_per_process=None, run_id=None, train_minibatch_fn=None,
                 train_steps_per_epoch=None, validation_steps_per_epoch=None,
                 transformation_fn=None, transformation_edit_fields=None,
                 transformation_removed_fields=None, train_reader_num_workers=None,
                 trainer_args=None, val_reader_num_workers=None, reader_pool_type=None,
                 label_shapes=None, inmemory_cache_all=False, num_gpus=None, logger=None,
                 log_every_n_steps=50, data_module=None, loader_num_epochs=None,
                 terminate_on_nan=False, profiler=None, debug_data_loader=False,
                 train_async_data_loader_queue_size=None,
                 val_async_data_loader_queue_size=None, use_gpu=True, mp_start_method=None,
                 backward_passes_per_step=1, continuous_cols=None, categorical_cols=None,
                 compress_sparse_cols=False, tensorflow_dataset_prefetch_buffer_size=0,
                 output_cols=None,
                 max_retries=3, checkpoint_every_steps=None, mlflow=None, dry_run=True):
        super().__init__()
        self.setParams(**self._input_kwargs)

    def _ignored(self) -> dict[str, str]:
        return {**super()._ignored(), **_LIGHTNING_IGNORED}

    def _model_class(self):
        return LightningModel

    def _model_params(self) -> dict:
        return {"input_shapes": self._input_shapes()}

    def _check_framework(self) -> None:
        package = lightning_package(self.value("model"))
        if not package:
            raise ConfigError(
                f"model must be a LightningModule (lightning.pytorch or pytorch_lightning), got "
                f"{type(self.value('model')).__name__}; train a plain torch.nn.Module with "
                "TorchEstimator")
        num_gpus = self.value("num_gpus")
        if num_gpus not in (None, 0, 1):
            raise ConfigError(f"num_gpus must be 0 or 1 (one GPU per rank; use more ranks for "
                              f"more GPUs), got {num_gpus!r}")
        args = self.value("trainer_args")
        if args is not None and not isinstance(args, dict):
            raise ConfigError(f"trainer_args must be a dict of Trainer arguments, got "
                              f"{type(args).__name__}")
        self._input_shapes()

    def _payload(self) -> dict:
        model = self.value("model")
        return {
            "package": lightning_package(model),
            "model": cloudpickle.dumps(model),
            "input_shapes": self._input_shapes(),
            "callbacks": cloudpickle.dumps(self.value("callbacks") or []),
            "logger": cloudpickle.dumps(self.value("logger")),
            "num_gpus": self.value("num_gpus"),
            "log_every_n_steps": self.value("log_every_n_steps"),
            "terminate_on_nan": self.value("terminate_on_nan"),
            "profiler": self.value("profiler"),
            "trainer_args": self.value("trainer_args"),
        }

    def _dry_run(self, sample, batch) -> None:
        # The forward pass only.
        dry_run.lightning_check(self, sample, batch, self._input_shapes())

    def _worker(self):
        return train_lightning


define(LightningEstimator, LIGHTNING_PARAMS)
define(LightningModel, carried_params(LightningModel, torch_adapter.TORCH_MODEL_PARAMS,
                                      LightningEstimator), base=MODEL_PARAMS)

# Horovod's names in horovod.spark.lightning.
TorchEstimator = LightningEstimator
TorchModel = LightningModel

__all__ = ["MIN_PL_VERSION", "LightningEstimator", "LightningModel", "TorchEstimator",
           "TorchModel"]
