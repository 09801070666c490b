"""TorchEstimator / TorchModel: fit a torch.nn.Module on a DataFrame with hvd_spark.

The training loop and the predictor live in ``torch_worker`` (no pyspark there);
torch is imported only inside functions, so the driver can build the estimator
(and this module imports) without it.
"""

from __future__ import annotations

import cloudpickle

from hvd_spark.errors import ConfigError
from hvd_spark.estimator.base import HvdEstimator, HvdModel, define
from hvd_spark.estimator.torch_worker import torch_predictor, train_torch

TORCH_PARAMS = [
    ("inputShapes", "shape of each feature input per row, e.g. [[1, 8, 8]]", None, None),
    ("lossConstructors", "callables returning the loss function(s)", None, None),
]


class TorchModel(HvdModel):
    """A TorchEstimator's trained model; ``transform`` adds ``<label>__output`` columns."""

    def _predictor_factory(self):
        return torch_predictor

    def getModel(self):  # noqa: N802 - Spark ML naming
        """The trained torch module (on CPU, in eval mode)."""
        return cloudpickle.loads(self.model_bytes)["model"]


class TorchEstimator(HvdEstimator):
    """Spark ML Estimator training a torch model with hvd_spark's DistributedOptimizer.

    Keywords are Horovod's: ``num_proc, model, optimizer, loss, loss_constructors,
    metrics, feature_cols, label_cols, input_shapes, batch_size, val_batch_size, epochs,
    validation, store, run_id, shuffle, random_seed, verbose, sample_weight_col,
    train_steps_per_epoch, validation_steps_per_epoch, partitions_per_process,
    gradient_compression, backward_passes_per_step, use_gpu`` and ``output_cols``.

    The optimizer is re-created on every rank from its class and ``defaults`` bound to
    that rank's copy of the model; its learning rate is used as given (not scaled by
    the number of ranks: scale it yourself if you want the Horovod convention).
    With ``sample_weight_col``, the loss must return per-row values
    (``reduction="none"``); they are weighted and averaged.
    """

    def _model_class(self):
        return TorchModel

    def _check_framework(self) -> None:
        import torch

        model, optimizer = self.value("model"), self.value("optimizer")
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if self.value("loss") is None and self.value("lossConstructors") is None:
            raise ConfigError("TorchEstimator needs loss=... or loss_constructors=[...]")

    def _payload(self) -> dict:
        optimizer = self.value("optimizer")
        return {
            "model": cloudpickle.dumps(self.value("model")),
            "optimizer_cls": type(optimizer),
            "optimizer_defaults": dict(optimizer.defaults),
            "loss": self.value("loss"),
            "loss_constructors": self.value("lossConstructors"),
            "metrics": self.value("metrics") or [],
            "input_shapes": self.value("inputShapes"),
        }

    def _worker(self):
        return train_torch


define(TorchEstimator, TORCH_PARAMS)
