"""TorchEstimator / TorchModel: fit a torch.nn.Module on a DataFrame with hvd_spark.

The training loop and the predictor live in ``torch_worker`` (no pyspark there);
torch is imported only inside functions, so the driver can build the estimator
(and this module imports) without it.
"""

from __future__ import annotations

import io
import math
from typing import Any

import cloudpickle

from hvd_spark.errors import ConfigError
from hvd_spark.estimator import dry_run, learning_rate, torch_amp
from hvd_spark.estimator.base import MODEL_PARAMS, HvdEstimator, HvdModel, define
from hvd_spark.estimator.lightning_strategy import lightning_package
from hvd_spark.estimator.params import keyword_only_params
from hvd_spark.estimator.torch_worker import metric_groups, torch_predictor, train_torch
from hvd_spark.estimator.train_spec import batch_shape
from hvd_spark.estimator.tuning import carried_params

TORCH_PARAMS = [
    ("input_shapes", "shape of each feature input, Horovod's [-1, ...] or one row's", None,
     None),
    ("loss_constructors", "callables returning the loss function(s)", None, None),
    ("train_minibatch_fn", "callable returning Horovod's train_minibatch(model, optimizer, "
     "transform_outputs, loss_fn, inputs, labels, sample_weights, backward_passes_per_step, "
     "batch_idx) -> (outputs, loss)", None, None),
    learning_rate.PARAM_SPEC,
    learning_rate.RATE_SPEC,
    dry_run.PARAM_SPEC,
    torch_amp.PARAM_SPEC,
]

TORCH_MODEL_PARAMS = [
    ("input_shapes", "shape of each feature input (with the -1 batch dimension)", None, None),
    ("loss_constructors", "callables returning the loss function(s)", None, None),
]


class TorchModel(HvdModel):
    """A TorchEstimator's trained model; ``transform`` adds ``<label>__output`` columns.

    ``getModel()`` is the trained module (CPU, eval mode) and ``getOptimizer()`` an
    optimizer over its parameters holding the trained state and every param group.
    """

    def __init__(self) -> None:
        super().__init__()
        self.optimizer_bytes = b""
        self._module: Any = None

    def predictor_factory(self):
        return torch_predictor

    def _set_extra(self, result: dict) -> None:
        self.optimizer_bytes = result.get("optimizer", b"")

    def getModel(self):  # noqa: N802 - Spark ML naming
        """The trained torch module (on CPU, in eval mode); the same object every call."""
        if self._module is None:
            self._module = cloudpickle.loads(self.model_bytes)["model"]
        return self._module

    def getOptimizer(self):  # noqa: N802 - Spark ML naming
        """A new optimizer of the user's class over ``getModel()``'s parameters, with the
        trained state and the param groups as trained."""
        import torch

        if not self.optimizer_bytes:
            return None
        saved = torch.load(io.BytesIO(self.optimizer_bytes), map_location="cpu",
                           weights_only=False)
        named = dict(self.getModel().named_parameters())
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [named[n] for n in names]}
                  for g, names in zip(saved["state"]["param_groups"], saved["group_names"])]
        try:
            optimizer = saved["cls"](groups, **saved["defaults"])
        except TypeError:  # a custom class whose constructor takes other keywords
            optimizer = saved["cls"](groups)
        optimizer.load_state_dict(saved["state"])
        return optimizer

    def getHistory(self) -> list[dict]:  # noqa: N802 - Spark ML naming
        """Horovod's torch history: one dict per epoch, ``{"epoch": 0, "train": {"loss":
        ..., "all_metrics": [{"group_0_<label>": ...}]}, "validation": {...}}``.

        As in Horovod, ``epoch`` counts from 0 here and metrics keep Horovod's
        ``group_<i>_<label>`` names, so code written for Horovod reads it unchanged. The
        console, TensorBoard, MLflow and ``getEpochHistory()`` count epochs from 1 and name
        metrics as Keras does (``accuracy``, ``val_accuracy``).
        """
        out = []
        for record in self.records:
            entry: dict[str, Any] = {"epoch": record["epoch"] - 1}
            for stage, prefix in (("train", ""), ("validation", "val_")):
                values = {k[len(prefix):]: v for k, v in record.items()
                          if k != "epoch" and k.startswith(prefix)
                          and (prefix or not k.startswith("val_"))}
                if not values:
                    continue
                groups: dict[int, dict[str, float]] = {}
                for name, value in values.items():
                    if name.startswith("group_"):
                        groups.setdefault(int(name.split("_")[1]), {})[name] = value
                entry[stage] = {"loss": values.get("loss"),
                                "all_metrics": [groups[i] for i in sorted(groups)]}
            out.append(entry)
        return out

    def getEpochHistory(self) -> list[dict]:  # noqa: N802 - Spark ML naming
        """One flat record per epoch, as the console shows them: ``{"epoch": 1, "loss": ...,
        "val_loss": ..., "accuracy": ..., "group_0_label": ...}`` (epochs from 1; each
        metric under its plain name and Horovod's; averaged over ranks)."""
        return [dict(r) for r in self.records]

    def _persisted_blobs(self) -> dict[str, bytes]:
        return {**super()._persisted_blobs(), "optimizer.bin": self.optimizer_bytes}

    def _blob_names(self) -> list[str]:
        return [*super()._blob_names(), "optimizer.bin"]

    def _restore_blobs(self, blobs: dict[str, bytes]) -> None:
        super()._restore_blobs(blobs)
        self.optimizer_bytes = blobs["optimizer.bin"]

    def _init_empty(self) -> None:
        TorchModel.__init__(self)


class TorchInputShapes:
    """The ``input_shapes`` checks TorchEstimator and LightningEstimator share."""

    def _input_shapes(self) -> list[tuple[int, ...]] | None:
        shapes = self.value("input_shapes")
        if shapes is None:
            return None
        features = self.value("feature_cols") or []
        if not isinstance(shapes, (list, tuple)) or len(shapes) != len(features):
            raise ConfigError(f"input_shapes must hold one shape per feature column "
                              f"({len(features)}), got {shapes!r}")
        return [batch_shape(s, "input_shapes") for s in shapes]

    def _check_dataset(self, dataset) -> None:
        shapes = self.value("input_shapes")
        for col, shape in zip(self.value("feature_cols"), shapes or []):
            size = math.prod(dataset.column(col).shape)
            batch_shape(shape, f"input_shapes (column {col!r})", size)


class TorchEstimator(TorchInputShapes, HvdEstimator):
    """Spark ML Estimator training a torch model with hvd_spark's DistributedOptimizer.

    Parameters are Horovod's ``horovod.spark.torch.TorchEstimator``'s, with its meaning,
    plus ``output_cols``; see ``help(TorchEstimator.__init__)``'s signature and the guide
    ``docs/guides/porting.md`` ("Spark") for what differs:

    - ``input_shapes`` may have Horovod's leading -1 batch dimension (``[[-1, 1, 28,
      28]]``) or be the shape of one row (``[[1, 28, 28]]``).
    - The optimizer is used as given: every param group and its settings, mapped onto
      each rank's copy of the model; it must be built over the model's parameters.
    - As in Horovod, each rank trains with every param group's learning rate times the
      number of ranks; checkpoints, ``getOptimizer()`` and a resumed fit carry the rate
      as given. ``scale_learning_rate=False`` (hvd_spark only) keeps the rate as given.
    - ``learning_rate`` (hvd_spark only) replaces every param group's rate, on a copy of
      the optimizer (the user's is not changed), before that rule.
    - With ``sample_weight_col``, a loss module must return per-row values
      (``reduction="none"``); a loss function is called with ``reduction="none"``.
    - ``use_gpu`` (default True) trains on a GPU when the rank has one, else on the CPU.
    - ``mixed_precision`` (hvd_spark only): ``"bf16"`` trains under bfloat16 autocast,
      ``"fp16"`` under float16 autocast with a ``GradScaler`` (Horovod's recipe); None
      (default) in float32. See ``hvd_spark.estimator.torch_amp``.
    """

    _step_checkpoints = True

    @keyword_only_params
    def __init__(self, num_proc=None, data_module=None, model=None, backend=None, store=None,
                 optimizer=None, loss=None, loss_constructors=None, metrics=None,
                 loss_weights=None, sample_weight_col=None, gradient_compression=None,
                 feature_cols=None, continuous_cols=None, categorical_cols=None,
                 input_shapes=None, validation=None, label_cols=None, callbacks=None,
                 batch_size=None, val_batch_size=None, epochs=None, verbose=1,
                 random_seed=None, shuffle_buffer_size=None, shuffle=True,
                 partitions_per_process=None, run_id=None, train_minibatch_fn=None,
                 train_steps_per_epoch=None, validation_steps_per_epoch=None,
                 transformation_fn=None, train_reader_num_workers=None,
                 val_reader_num_workers=None, reader_pool_type="thread", label_shapes=None,
                 inmemory_cache_all=False, use_gpu=True, mp_start_method=None,
                 backward_passes_per_step=1, compress_sparse_cols=False,
                 transformation_edit_fields=None, transformation_removed_fields=None,
                 tensorflow_dataset_prefetch_buffer_size=0, output_cols=None,
                 max_retries=3, checkpoint_every_steps=None, scale_learning_rate=True,
                 learning_rate=None, mlflow=None, dry_run=True, mixed_precision=None):
        super().__init__()
        self.setParams(**self._input_kwargs)

    def _extra(self) -> dict:
        return {learning_rate.PARAM: self.value(learning_rate.PARAM),
                torch_amp.PARAM: self.value(torch_amp.PARAM)}

    def _learning_rate_note(self, num_proc: int) -> str:
        rates = [group["lr"] for group in self._optimizer().param_groups]
        return learning_rate.describe(rates, num_proc, self.value(learning_rate.PARAM),
                                      type(self).__name__)

    def _optimizer(self) -> Any:
        """The optimizer the ranks start from: the user's, or a copy at ``learning_rate``."""
        return learning_rate.torch_at_rate(self.value("optimizer"),
                                           self.value(learning_rate.RATE))

    def _ignored(self) -> dict[str, str]:
        return {**super()._ignored(),
                "callbacks": "TorchEstimator's loop has no callback hooks (Horovod's ignores "
                             "them too); use LightningEstimator for callbacks"}

    def _model_class(self):
        return TorchModel

    def _model_params(self) -> dict:
        return {"input_shapes": self._input_shapes(),
                "loss_constructors": self.value("loss_constructors")}

    def _check_framework(self) -> None:
        import torch

        model, optimizer = self.value("model"), self.value("optimizer")
        if lightning_package(model):
            raise ConfigError(
                f"model is a LightningModule ({type(model).__name__}): train it with "
                "LightningEstimator (Horovod's horovod.spark.lightning.TorchEstimator is "
                "hvd_spark.estimator.lightning.TorchEstimator)")
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        own = {id(p) for p in model.parameters()}
        if any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
            raise ConfigError("optimizer holds parameters that are not the model's: build it "
                              "over this model's parameters (e.g. model.parameters())")
        has_loss = self.value("loss") is not None
        has_makers = self.value("loss_constructors") is not None
        if has_loss == has_makers:
            raise ConfigError("TorchEstimator needs exactly one of loss=... and "
                              "loss_constructors=[...]")
        weights, labels = self.value("loss_weights"), self.value("label_cols")
        if weights is not None and len(weights) != len(labels):
            raise ConfigError(f"loss_weights must hold one weight per label column "
                              f"({len(labels)}), got {weights}")
        for fns in metric_groups(self.value("metrics")):
            if not all(callable(fn) for fn in fns):
                raise ConfigError("metrics must be functions (output, label) -> value, or "
                                  "lists of them (one per label column)")
        fn = self.value("train_minibatch_fn")
        if fn is not None and not callable(fn):
            raise ConfigError("train_minibatch_fn must be a function returning the "
                              "train_minibatch function, as in Horovod")
        self._input_shapes()
        learning_rate.check_rate(self.value(learning_rate.RATE))
        torch_amp.check_mode(self.value(torch_amp.PARAM), fn is not None)

    def _payload(self) -> dict:
        return {
            # Pickled together: the optimizer's parameters stay the model's.
            "model_and_optimizer": cloudpickle.dumps((self.value("model"), self._optimizer())),
            "loss": self.value("loss"),
            "loss_constructors": self.value("loss_constructors"),
            "loss_weights": self.value("loss_weights"),
            "metrics": self.value("metrics") or [],
            "input_shapes": self._input_shapes(),
            "train_minibatch_fn": self.value("train_minibatch_fn"),
        }

    def _dry_run(self, sample, batch) -> None:
        dry_run.torch_check(self, sample, batch, self._input_shapes(), self._label_shapes())

    def _worker(self):
        return train_torch


define(TorchEstimator, TORCH_PARAMS)
define(TorchModel, carried_params(TorchModel, TORCH_MODEL_PARAMS, TorchEstimator),
       base=MODEL_PARAMS)
