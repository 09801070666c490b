"""The LightningEstimator's worker side: ``Trainer.fit`` on every rank over hvd_spark.

Batches come from the one sharded reader as dicts of tensors (column -> tensor, features
reshaped to ``input_shapes``), as Horovod's Lightning data module gives them to
``training_step(batch, batch_idx)``. Rank 0 saves a Lightning checkpoint to the store
every epoch, and a fit with the same ``run_id`` resumes from it (``ckpt_path``).
No pyspark here (an import contract).
"""

from __future__ import annotations

import importlib
import os
import tempfile
from typing import Any

import cloudpickle

from hvd_spark.estimator import history as hist
from hvd_spark.estimator.lightning_strategy import strategy_class
from hvd_spark.estimator.mlflow_ranks import nest_mlflow_logger
from hvd_spark.estimator.torch_worker import as_tuple, batch_inputs, to_tensor, training_device
from hvd_spark.estimator.train_spec import (
    TrainSpec,
    check_loss,
    make_readers,
    set_start_method,
)


class TensorBatches:
    """An iterable of one split's batches as dicts of tensors; each ``iter()`` is one epoch."""

    def __init__(self, source: Any, spec: TrainSpec, shapes: list | None, first_epoch: int):
        self.source, self.spec, self.shapes = source, spec, shapes
        self.epoch = first_epoch

    def __len__(self) -> int:
        return self.source.steps_per_epoch

    def __iter__(self):
        import torch

        ds = self.spec.dataset
        epoch, self.epoch = self.epoch, self.epoch + 1
        for batch in self.source.epoch(epoch):
            inputs = batch_inputs(batch, ds.feature_cols, self.shapes, torch)
            out = dict(zip(ds.feature_cols, inputs))
            label_shapes = self.spec.label_shapes or [None] * len(ds.label_cols)
            for col, shape in zip(ds.label_cols, label_shapes):
                t = to_tensor(batch[col], torch)
                t = t.float() if t.is_floating_point() else t
                out[col] = t.reshape(shape) if shape else t
            if ds.sample_weight_col:
                out[ds.sample_weight_col] = to_tensor(batch[ds.sample_weight_col], torch).float()
            yield out


def _callbacks(pl: Any, spec: TrainSpec, history: list[dict], workdir: str,
               terminate_on_nan: bool) -> list:
    """Our callbacks: per-epoch record + report + store checkpoint; NaN guard."""
    import hvd_spark.torch as hvd

    class EpochEnd(pl.Callback):
        """Records the epoch's metrics (averaged over ranks), reports them and, on rank 0,
        uploads a Lightning checkpoint to the store (resume by run_id)."""

        def on_train_epoch_end(self, trainer, module):
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                       if getattr(v, "numel", lambda: 1)() == 1}
            record = hist.average_over_ranks({"epoch": trainer.current_epoch + 1, **metrics})
            history.append(record)
            if hvd.rank() == 0:
                hist.report(record, spec.epochs, spec.verbose)
            if spec.store is None:
                return  # the direct path keeps no checkpoints
            path = os.path.join(workdir, "epoch.ckpt")
            trainer.save_checkpoint(path)  # every rank calls it; rank 0 writes
            if hvd.rank() == 0:
                with open(path, "rb") as f:
                    spec.store.save_checkpoint(spec.run_id, trainer.current_epoch, f.read())

        def state_dict(self):
            return {"history": list(history)}

        def load_state_dict(self, state):
            history[:] = state.get("history", [])

    class NanGuard(pl.Callback):
        """Horovod's ``terminate_on_nan``: stop with an error on a NaN or infinite loss."""

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is not None:
                check_loss(float(loss), trainer.current_epoch, batch_idx, spec,
                           trainer.num_training_batches, hvd.rank())

    return [EpochEnd(), *([NanGuard()] if terminate_on_nan else [])]


def train_lightning(spec: TrainSpec, payload: dict) -> dict | None:
    """Runs on every rank: a Lightning Trainer with hvd_spark's strategy."""
    set_start_method(spec.mp_start_method)
    import torch

    import hvd_spark.torch as hvd

    pl = importlib.import_module(payload["package"])
    hvd.init()
    if spec.framework_seed is not None:
        torch.manual_seed(spec.framework_seed)
    use_gpu = spec.use_gpu and payload["num_gpus"] != 0
    device = training_device(use_gpu, hvd.local_rank(), torch)
    module = cloudpickle.loads(payload["model"])
    shapes = payload["input_shapes"]
    train_src, val_src = make_readers(spec, hvd.rank(), hvd.size())
    history: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hvd_spark_lightning_") as workdir:
        logger = cloudpickle.loads(payload["logger"])
        nest_mlflow_logger(logger)  # under the driver's MLflow run, if there is one
        if logger is None:
            logger = pl.loggers.CSVLogger(os.path.join(workdir, "logs"), name="", version="")
        callbacks = [*(cloudpickle.loads(payload["callbacks"]) or []),
                     *_callbacks(pl, spec, history, workdir, payload["terminate_on_nan"])]
        kwargs = {
            "strategy": strategy_class(pl)(device, compression=spec.compression),
            "accelerator": "gpu" if device.type == "cuda" else "cpu", "devices": 1,
            "max_epochs": spec.epochs, "callbacks": callbacks, "logger": logger,
            "log_every_n_steps": payload["log_every_n_steps"], "num_sanity_val_steps": 0,
            "enable_progress_bar": False, "enable_model_summary": False,
            "use_distributed_sampler": False, "default_root_dir": workdir,
            "accumulate_grad_batches": spec.backward_passes_per_step,
            "profiler": payload["profiler"],
        }
        kwargs.update(payload["trainer_args"] or {})
        trainer = pl.Trainer(**kwargs)
        ckpt_path = None
        found = spec.store.latest_checkpoint(spec.run_id) if spec.start_epoch > 0 else None
        if found is not None:
            ckpt_path = os.path.join(workdir, "resume.ckpt")
            with open(ckpt_path, "wb") as f:
                f.write(found[1])
        first = found[0] + 1 if found is not None else 0
        val = TensorBatches(val_src, spec, shapes, first) if val_src is not None else None
        trainer.fit(module, train_dataloaders=TensorBatches(train_src, spec, shapes, first),
                    val_dataloaders=val, ckpt_path=ckpt_path)
        if hvd.rank() != 0:
            return None
        if spec.store is not None:
            spec.store.upload_dir(os.path.join(workdir, "logs"),
                                  spec.store.logs_path(spec.run_id))
        best = next((cb.best_model_path for cb in trainer.checkpoint_callbacks
                     if getattr(cb, "best_model_path", "")), "")
        if best:  # Horovod returns the best checkpoint's model when there is one
            module.load_state_dict(torch.load(best, map_location="cpu",
                                              weights_only=False)["state_dict"])
        logged = {k: float(v) for k, v in trainer.logged_metrics.items()
                  if getattr(v, "numel", lambda: 1)() == 1}
        if history:  # rank 0's own values -> the last epoch's, averaged over the ranks
            logged.update({k: v for k, v in history[-1].items() if k in logged})
    module.eval().cpu()
    sample = next(iter(train_src.epoch(0)))
    with torch.no_grad():
        outs = as_tuple(module(*batch_inputs(sample, spec.dataset.feature_cols, shapes, torch)))
    return {
        "model": cloudpickle.dumps({"model": module, "input_shapes": shapes}),
        "history": history, "logged_metrics": logged,
        "output_shapes": [tuple(o.shape[1:]) for o in outs],
    }
