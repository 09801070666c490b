"""The models and the plain (one-process) training loops of ``python -m hvd_spark.bench
convergence``, one ``Framework`` per library: torch, Keras and Lightning.

Each framework builds the same model twice from a seed (so the plain run and the
Estimator start from identical weights), trains it in this process with a global batch
of ``num_proc * batch_size`` rows, and builds the Estimator that trains it on
``num_proc`` ranks of ``batch_size`` rows each. The frameworks are imported only inside
functions, and the models are defined inside them too: cloudpickle then ships the
classes by value, so the ranks need not import this module.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

SIDE = 28  # the images' side after upscaling (Horovod's MNIST network expects 28x28)


@dataclass(frozen=True)
class Digits:
    """Train and held-out test images (flat ``SIDE * SIDE`` pixels in [0, 1]) and labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass(frozen=True)
class Plan:
    """One seed's training settings, shared by the plain run and the Estimator."""

    epochs: int
    batch_size: int  # rows per rank and step of the Estimator
    num_proc: int
    lr: float  # the learning rate given to the Estimator's optimizer
    seed: int
    plain_threads: int = 1  # torch threads of the plain run (each rank's: see _torch_threads)

    @property
    def global_batch(self) -> int:
        """Rows per optimizer step over all ranks: the plain run's batch."""
        return self.batch_size * self.num_proc


@dataclass
class Outcome:
    """What one plain run measured."""

    losses: list[float]  # mean training loss of each epoch
    accuracy: float  # on the held-out test rows
    wall_s: float  # the training loop alone


def _epoch_order(n: int, batch: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Row indices of one epoch's full batches, shuffled; the last partial batch is
    dropped, as the Estimators' reader does (equal steps on every rank)."""
    order = rng.permutation(n)
    for step in range(n // batch):
        yield order[step * batch:(step + 1) * batch]


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` while training plainly, then restored.

    Spark starts each rank with ``OMP_NUM_THREADS`` = ``spark.task.cpus`` (1 by default),
    so an Estimator's ranks train with one torch thread each; the plain run defaults to
    the same. It also keeps the plain run's time sane on a busy machine: two spinning
    OpenMP threads on two shared cores ran its loop 10-30x slower.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _horovod_mnist_net() -> Any:
    """Horovod's MNIST network (examples/spark/pytorch/pytorch_spark_mnist.py), unseeded."""
    import torch
    from torch import nn
    from torch.nn import functional as F  # noqa: N812 - torch's own convention

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
            self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
            self.conv2_drop = nn.Dropout2d()
            self.fc1 = nn.Linear(320, 50)
            self.fc2 = nn.Linear(50, 10)

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            x = features.float()
            x = F.relu(F.max_pool2d(self.conv1(x), 2))
            x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
            x = F.relu(self.fc1(x.view(-1, 320)))
            x = F.dropout(x, training=self.training)
            return F.log_softmax(self.fc2(x), dim=1)

    return Net()


def _torch_accuracy(model: Any, data: Digits) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        x = torch.from_numpy(data.x_test.reshape(-1, 1, SIDE, SIDE)).float()
        predicted = model(x).argmax(dim=1).numpy()
    return float(np.mean(predicted == data.y_test))


class Framework:
    """One library's model, plain loop and Estimator (subclasses fill them in)."""

    name = ""
    model = ""  # a short description for the header line
    estimator_name = ""

    def plain(self, data: Digits, plan: Plan, lr: float) -> Outcome:
        """Train in this process at ``plan.global_batch`` rows per step with ``lr``."""
        raise NotImplementedError

    def estimator(self, plan: Plan, store: str) -> Any:
        """The Estimator training the same model on ``plan.num_proc`` ranks."""
        raise NotImplementedError

    def curve(self, fitted: Any) -> list[float]:
        """The fitted model's mean training loss per epoch (averaged over the ranks)."""
        raise NotImplementedError


class TorchFramework(Framework):
    """Horovod's MNIST network, ``nll_loss``, SGD with momentum 0.5; TorchEstimator."""

    name = "torch"
    estimator_name = "TorchEstimator"
    model = "Horovod's MNIST convnet (SGD momentum 0.5, nll_loss)"

    @staticmethod
    def build(seed: int) -> Any:
        import torch

        torch.manual_seed(seed)
        return _horovod_mnist_net()

    def plain(self, data: Digits, plan: Plan, lr: float) -> Outcome:
        import torch
        from torch.nn import functional as F  # noqa: N812 - torch's own convention

        model = self.build(plan.seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
        x = torch.from_numpy(data.x_train.reshape(-1, 1, SIDE, SIDE)).float()
        y = torch.from_numpy(data.y_train)
        rng = np.random.default_rng(plan.seed)
        losses = []
        with _torch_threads(plan.plain_threads):
            start = time.perf_counter()
            for _ in range(plan.epochs):
                model.train()
                total, steps = 0.0, 0
                for idx in _epoch_order(len(x), plan.global_batch, rng):
                    optimizer.zero_grad()
                    loss = F.nll_loss(model(x[idx]), y[idx])
                    loss.backward()
                    optimizer.step()
                    total, steps = total + float(loss.detach()), steps + 1
                losses.append(total / max(steps, 1))
            wall = time.perf_counter() - start
            return Outcome(losses, _torch_accuracy(model, data), wall)

    def estimator(self, plan: Plan, store: str) -> Any:
        import torch

        from hvd_spark.estimator import TorchEstimator

        model = self.build(plan.seed)
        return TorchEstimator(
            num_proc=plan.num_proc, model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=plan.lr, momentum=0.5),
            loss=torch.nn.NLLLoss(), input_shapes=[[-1, 1, SIDE, SIDE]],
            feature_cols=["features"], label_cols=["label"], batch_size=plan.batch_size,
            epochs=plan.epochs, random_seed=plan.seed, store=store, verbose=0)

    def curve(self, fitted: Any) -> list[float]:
        return [float(epoch["train"]["loss"]) for epoch in fitted.getHistory()]


class KerasFramework(Framework):
    """The torch network's Keras twin (same layers, channels last, softmax output,
    sparse categorical cross-entropy, SGD with momentum 0.5); KerasEstimator."""

    name = "keras"
    estimator_name = "KerasEstimator"
    model = "the same convnet in Keras (SGD momentum 0.5, sparse CE)"

    @staticmethod
    def build(seed: int) -> Any:
        import keras
        from keras import layers

        keras.utils.set_random_seed(seed)
        return keras.Sequential([
            keras.Input((SIDE, SIDE, 1)),
            layers.Conv2D(10, 5), layers.MaxPooling2D(2), layers.ReLU(),
            layers.Conv2D(20, 5), layers.SpatialDropout2D(0.5), layers.MaxPooling2D(2),
            layers.ReLU(), layers.Flatten(), layers.Dense(50, activation="relu"),
            layers.Dropout(0.5), layers.Dense(10, activation="softmax"),
        ])

    def plain(self, data: Digits, plan: Plan, lr: float) -> Outcome:
        import keras

        model = self.build(plan.seed)
        model.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.5),
                      loss="sparse_categorical_crossentropy")
        x = data.x_train.reshape(-1, SIDE, SIDE, 1).astype(np.float32)
        steps = len(x) // plan.global_batch

        def batches() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            # The same full shuffled batches as the torch loop: fit's own numpy path
            # would also train on the last partial batch, which the Estimator drops.
            rng = np.random.default_rng(plan.seed)
            while True:
                for idx in _epoch_order(len(x), plan.global_batch, rng):
                    yield x[idx], data.y_train[idx]

        start = time.perf_counter()
        history = model.fit(batches(), steps_per_epoch=steps, epochs=plan.epochs, verbose=0,
                            shuffle=False)
        wall = time.perf_counter() - start
        probs = model(data.x_test.reshape(-1, SIDE, SIDE, 1).astype(np.float32), training=False)
        accuracy = float(np.mean(np.argmax(np.asarray(probs), axis=1) == data.y_test))
        return Outcome([float(v) for v in history.history["loss"]], accuracy, wall)

    def estimator(self, plan: Plan, store: str) -> Any:
        import keras

        from hvd_spark.estimator import KerasEstimator

        return KerasEstimator(
            num_proc=plan.num_proc, model=self.build(plan.seed),
            optimizer=keras.optimizers.SGD(plan.lr, momentum=0.5),
            loss="sparse_categorical_crossentropy", feature_cols=["features"],
            label_cols=["label"], batch_size=plan.batch_size, epochs=plan.epochs,
            random_seed=plan.seed, store=store, verbose=0)

    def curve(self, fitted: Any) -> list[float]:
        return [float(v) for v in fitted.getHistory()["loss"]]


def _lightning_module(lr: float) -> Any:
    """Horovod's MNIST network in a LightningModule; batches are dicts of column -> tensor
    (what LightningEstimator hands ``training_step``; the plain loader yields the same)."""
    import lightning.pytorch as pl
    import torch
    from torch.nn import functional as F  # noqa: N812 - torch's own convention

    class LitNet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _horovod_mnist_net()

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            return self.net(features)

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            loss = F.nll_loss(self(batch["features"]), batch["label"])
            # The epoch's mean, as the torch loop's history holds.
            self.log("train_loss", loss, on_step=False, on_epoch=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.5)

    return LitNet()


class LightningFramework(Framework):
    """The torch network in a LightningModule; a plain ``Trainer`` vs LightningEstimator."""

    name = "lightning"
    estimator_name = "LightningEstimator"
    model = "the torch convnet in a LightningModule"

    @staticmethod
    def build(seed: int, lr: float) -> Any:
        import torch

        torch.manual_seed(seed)
        return _lightning_module(lr)

    def plain(self, data: Digits, plan: Plan, lr: float) -> Outcome:
        import logging

        import lightning.pytorch as pl
        import torch

        # The Trainer's banner (GPU available: ..., TPU available: ...) is noise here.
        logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
        module = self.build(plan.seed, lr)
        x = torch.from_numpy(data.x_train.reshape(-1, 1, SIDE, SIDE)).float()
        y = torch.from_numpy(data.y_train)
        rows = [{"features": a, "label": b} for a, b in zip(x, y)]
        loader = torch.utils.data.DataLoader(
            rows, batch_size=plan.global_batch, shuffle=True, drop_last=True,
            generator=torch.Generator().manual_seed(plan.seed))
        losses: list[float] = []

        class EpochLoss(pl.Callback):
            def on_train_epoch_end(self, trainer: Any, _module: Any) -> None:
                losses.append(float(trainer.callback_metrics["train_loss"]))

        trainer = pl.Trainer(max_epochs=plan.epochs, accelerator="cpu", devices=1,
                             logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, callbacks=[EpochLoss()])
        with _torch_threads(plan.plain_threads):
            start = time.perf_counter()
            trainer.fit(module, train_dataloaders=loader)
            wall = time.perf_counter() - start
            return Outcome(losses, _torch_accuracy(module, data), wall)

    def estimator(self, plan: Plan, store: str) -> Any:
        from hvd_spark.estimator import LightningEstimator

        return LightningEstimator(
            num_proc=plan.num_proc, model=self.build(plan.seed, plan.lr),
            input_shapes=[[-1, 1, SIDE, SIDE]], feature_cols=["features"],
            label_cols=["label"], batch_size=plan.batch_size, epochs=plan.epochs,
            random_seed=plan.seed, store=store, verbose=0)

    def curve(self, fitted: Any) -> list[float]:
        return [float(r["train_loss"]) for r in fitted.getEpochHistory()]


FRAMEWORKS: dict[str, Framework] = {
    f.name: f for f in (TorchFramework(), KerasFramework(), LightningFramework())}


def estimator_lr(estimator: Any, plan: Plan) -> float:
    """The learning rate each rank's optimizer steps with: ``lr * num_proc`` when the
    Estimator scales it (Horovod's rule, ``scale_learning_rate``), else ``lr``."""
    scales = (estimator.hasParam("scale_learning_rate")
              and bool(estimator.getOrDefault("scale_learning_rate")))
    return plan.lr * plan.num_proc if scales else plan.lr
