"""Shared pieces of the equivalence tests (issue 33): N ranks at batch b end where the plain
framework ends in one process at batch N*b, from the same initial weights, on the same
global batches in the same order.

The ranks' jobs and the plain reference loops live here, so both sides run the same code.
This module is pickled by value to the ranks (tests/ is not on the workers' path), and
frameworks are imported inside functions: a torch job never loads TensorFlow.

Tolerances (``tolerance``): the distributed run computes each global gradient as the
mean of N per-rank means (with backward_passes_per_step, of per-micro-batch means too),
the plain run as one mean: the same sum in another order, so they differ by float32
rounding (~1e-7 relative per gradient), which training carries along. The bound is
``max|w_dist - w_plain| <= rel * max|w_plain - w_init| + abs``:

- exact arithmetic: rel 1e-6, about 8 float32 ulps of the parameters' movement (measured
  ratios: 9e-8 to 7.5e-7), plus abs 1e-7 (~2 ulps of a weight of magnitude 1) for weights
  that barely move. Adam adds abs 3e-4 * lr: its first step is ~``lr * g / (|g| + eps)``,
  so a gradient component that nearly cancels, with |g| near eps, takes a step whose size
  hangs on the rounding of g, amplified up to ``lr / eps`` times. In the Keras model's
  first step one component is -7.8e-6, the mean of the ranks' -0.0326 and +0.0326
  (Keras's Adam compares eps = 1e-7 with sqrt(1 - beta_2) * |g| = 2.5e-7 there): measured
  6.6e-7 = 6.6e-5 * lr, and plain Keras compiled and plain Keras eager differ as much.
- fp16 gradient compression: each rank's gradient is rounded to 11 bits (~2.4e-4
  relative) before the average; measured ratios 1.4e-4 to 2.7e-4, so rel 5e-3. Keras's
  Adam with fp16 is not compared: in its first step a component of 2.3e-5 is the mean of
  the ranks' -0.0966 and +0.0966, below fp16's spacing there (6e-5), so the average is 0
  and Adam takes no step where plain Adam takes 0.88 * lr (measured ratio 0.05): fp16's
  limit, not a bug (Horovod's fp16 compressor does the same).

A real bug moves weights by a sizeable fraction of their movement (measured with SGD on
this data): a rank's gradient lost 0.16, the learning rate not scaled 0.45, the sum of
accumulated gradients applied instead of their mean 0.86, a rank's first accumulated
gradient overwritten with rank 0's 0.12. Adam's normalised step hides a constant factor
on the gradients (that sum-for-mean bug: 3e-5 with Adam), so accumulation is also
checked with SGD wherever a module has a single backward_passes_per_step case.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import cloudpickle
import numpy as np

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on the workers' path

N = 2  # ranks
BATCH = 16  # rows per rank per batch
ROWS, FEATURES, HIDDEN, CLASSES = 256, 8, 16, 3
EPOCHS = 2
SGD_LR, MOMENTUM, ADAM_LR = 0.05, 0.9, 0.01
LR = {"sgd": SGD_LR, "adam": ADAM_LR}

# The Torch and Keras Estimators' cases, one fit each (a fit costs ~15-20 s); the
# run()-based tests cover the full matrix and fp16 (the estimator hands
# gradient_compression to the same DistributedOptimizer). Adam at bpps 1 and the scaled
# rate; SGD with momentum at bpps 2 and the rate as given: SGD's step is proportional to
# the gradient, so how the accumulated gradients are combined shows (Adam's normalised
# step would hide a factor on them).
ESTIMATOR_CASES = {
    "adam_scaled_lr": {"opt": "adam", "bpps": 1, "fp16": False, "scale": True},
    "sgd_momentum_bpps2_lr_as_given": {"opt": "sgd", "bpps": 2, "fp16": False,
                                       "scale": False},
}
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "HVD_SPARK_TIMEOUT": "120", "OMP_NUM_THREADS": "1"}

Weights = list[np.ndarray]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``max|w_dist - w_plain| <= rel * movement + abs`` (see the module docstring)."""

    rel: float
    abs: float


def tolerance(optimizer: str, lr: float, fp16: bool) -> Tolerance:
    """The bound for a run with ``optimizer`` at learning rate ``lr`` (module docstring)."""
    if fp16:
        return Tolerance(rel=5e-3, abs=1e-6)
    return Tolerance(rel=1e-6, abs=1e-7 + (3e-4 * lr if optimizer == "adam" else 0.0))


@dataclasses.dataclass(frozen=True)
class Comparison:
    """How far the distributed weights are from the plain ones, and how far those moved."""

    diff: float  # max |w_dist - w_plain| over all parameters
    movement: float  # max |w_plain - w_init| over all parameters

    @property
    def ratio(self) -> float:
        """``diff`` relative to the movement of the parameters."""
        return self.diff / self.movement

    def check(self, tol: Tolerance, what: str) -> None:
        """Assert that the weights agree within ``tol`` (and that training moved them)."""
        assert self.movement > 1e-2, f"{what}: the weights barely moved ({self.movement:.3g})"
        bound = tol.rel * self.movement + tol.abs
        assert self.diff <= bound, (
            f"{what}: max|w_dist - w_plain| = {self.diff:.3g} > {bound:.3g} = {tol.rel:g} * "
            f"movement {self.movement:.3g} + {tol.abs:.3g} (ratio to the movement "
            f"{self.ratio:.3g})")

    def __str__(self) -> str:
        return f"diff {self.diff:.3g}, movement {self.movement:.3g}, ratio {self.ratio:.3g}"


def compare(dist: Sequence[np.ndarray], plain: Sequence[np.ndarray],
            init: Sequence[np.ndarray]) -> Comparison:
    """Compare parameter lists (same order and shapes) of the distributed and plain runs."""
    assert len(dist) == len(plain) == len(init) > 0, (len(dist), len(plain), len(init))
    for a, b, c in zip(dist, plain, init):
        assert a.shape == b.shape == c.shape, (a.shape, b.shape, c.shape)
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - b))) for a, b in zip(dist, plain))
    moved = max(float(np.max(np.abs(np.asarray(b, np.float64) - c))) for b, c in zip(plain, init))
    return Comparison(diff, moved)


def assert_same_on_ranks(per_rank: Sequence[Sequence[np.ndarray]], what: str) -> None:
    """Every rank ends with bitwise the same weights as rank 0."""
    for rank, weights in enumerate(per_rank[1:], start=1):
        for i, (a, b) in enumerate(zip(per_rank[0], weights)):
            assert np.array_equal(a, b), f"{what}: parameter {i} differs on rank {rank}"


# ------------------------------------------------------------------------------- data


def dataset() -> tuple[np.ndarray, np.ndarray]:
    """``ROWS`` rows of float32 features and int64 class labels from a noisy linear teacher."""
    rng = np.random.default_rng(33)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    logits = x @ rng.normal(size=(FEATURES, CLASSES)) + 0.5 * rng.normal(size=(ROWS, CLASSES))
    return x, np.argmax(logits, axis=1).astype(np.int64)


def rank_rows(step: int, rank: int, size: int, batch: int) -> slice:
    """Rows of ``rank``'s ``step``-th batch: its share of the ``step``-th global batch."""
    start = step * size * batch + rank * batch
    return slice(start, start + batch)


def global_batches(x: np.ndarray, y: np.ndarray, rows: int, epochs: int
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The plain run's batches: consecutive blocks of ``rows`` rows, every epoch again."""
    for _ in range(epochs):
        for start in range(0, len(x) - rows + 1, rows):
            yield x[start:start + rows], y[start:start + rows]


class BatchRecorder:
    """A ``transformation_fn`` that saves every batch a rank trains on and returns it as is.

    Files are ``<directory>/rank<r>_<k>.npz`` (``k`` counts this rank's batches), so the
    driver can rebuild the global batches (``recorded_global_batches``).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.count = 0

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rank = os.environ.get("HVD_SPARK_RANK")
        if rank is None:  # the Estimator's dry run on the driver: not a training batch
            return batch
        path = os.path.join(self.directory, f"rank{rank}_{self.count:05d}.npz")
        np.savez(path, **batch)
        self.count += 1
        return batch


def recorded_global_batches(directory: str, size: int, steps: int, feature: str, label: str
                            ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first ``steps`` global batches the ranks trained on: the k-th batches of all
    ranks, concatenated in rank order. (Later recordings, e.g. the sample batch the
    worker runs through the final model, are ignored.)"""
    per_rank = []
    for rank in range(size):
        names = sorted(n for n in os.listdir(directory) if n.startswith(f"rank{rank}_"))
        assert len(names) >= steps, f"rank {rank} recorded {len(names)} batches, want {steps}"
        per_rank.append([dict(np.load(os.path.join(directory, n))) for n in names[:steps]])
    out = []
    for parts in zip(*per_rank):
        assert len({len(p[label]) for p in parts}) == 1, "ranks trained on unequal batches"
        x = np.concatenate([p[feature] for p in parts]).astype(np.float32)
        out.append((x.reshape(len(x), -1), np.concatenate([p[label] for p in parts])))
    return out


def merge_steps(batches: list[tuple[np.ndarray, np.ndarray]], passes: int
                ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Global batches of ``passes`` consecutive recorded steps each: what one optimizer
    step sees with ``backward_passes_per_step=passes``."""
    assert len(batches) % passes == 0, (len(batches), passes)
    return [(np.concatenate([b[0] for b in batches[i:i + passes]]),
             np.concatenate([b[1] for b in batches[i:i + passes]]))
            for i in range(0, len(batches), passes)]


def check_epochs_cover_dataset(batches: list[tuple[np.ndarray, np.ndarray]], epochs: int,
                               x: np.ndarray) -> None:
    """Each epoch's global batches hold every row of ``x`` exactly once (sanity of the
    recording and the pairing: nothing lost, nothing duplicated)."""
    per_epoch = len(batches) // epochs
    want = sorted(map(bytes, x))
    for e in range(epochs):
        rows = np.concatenate([b[0] for b in batches[e * per_epoch:(e + 1) * per_epoch]])
        assert sorted(map(bytes, rows)) == want, f"epoch {e}: the batches do not cover the rows"


# ------------------------------------------------------------------------------- torch


def torch_model(seed: int = 0) -> Any:
    """The 8 -> 16 -> 3 tanh MLP, seeded."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, CLASSES))


def torch_optimizer(name: str, params: Iterable[Any], lr: float) -> Any:
    """``"sgd"``: SGD with momentum; ``"adam"``: Adam."""
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)
    return torch.optim.Adam(params, lr=lr)


def torch_weights(model: Any) -> Weights:
    """The model's parameters as float32 numpy copies, in ``parameters()`` order."""
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def torch_plain(model: Any, optimizer: str, lr: float,
                batches: Iterable[tuple[np.ndarray, np.ndarray]]) -> Weights:
    """Plain torch: one step per batch with the mean cross-entropy; trains ``model``."""
    import torch

    opt = torch_optimizer(optimizer, model.parameters(), lr)
    model.train()
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)),
                                                 torch.from_numpy(y))
        loss.backward()
        opt.step()
    return torch_weights(model)


def torch_plain_weighted(model: Any, optimizer: str, lr: float,
                         steps: Iterable[tuple[np.ndarray, np.ndarray, float]]) -> Weights:
    """Plain torch with a weight on each step's mean loss (a partial accumulation's step
    is its batches' mean loss times passes done / backward_passes_per_step)."""
    import torch

    opt = torch_optimizer(optimizer, model.parameters(), lr)
    model.train()
    for x, y, weight in steps:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)),
                                                 torch.from_numpy(y))
        (loss * weight).backward()
        opt.step()
    return torch_weights(model)


def torch_run_job(cases: dict[str, dict]) -> dict[str, dict[str, Weights]]:
    """Each rank: for every case ``{"opt", "lr", "bpps", "fp16"}``, train the seeded MLP
    with ``hvd.DistributedOptimizer`` on its ``BATCH`` rows of every global batch; with
    ``bpps`` > 1, ``bpps`` batches each (loss divided by ``bpps``) per optimizer step.
    Returns case -> ``{"init": weights, "final": weights}``."""
    import torch

    import hvd_spark.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = dataset()
    steps = ROWS // (size * BATCH)
    out = {}
    for name, case in cases.items():
        model = torch_model()
        opt = torch_optimizer(case["opt"], model.parameters(), case["lr"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        init = torch_weights(model)
        compression = hvd.Compression.fp16 if case.get("fp16") else hvd.Compression.none
        bpps = case.get("bpps", 1)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression, backward_passes_per_step=bpps)
        model.train()
        for _ in range(EPOCHS):
            for step in range(steps):
                rows = rank_rows(step, rank, size, BATCH)
                loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x[rows])),
                                                         torch.from_numpy(y[rows]))
                (loss / bpps).backward()
                if (step + 1) % bpps == 0:
                    opt.step()
                    opt.zero_grad()
        opt.remove_hooks()
        out[name] = {"init": init, "final": torch_weights(model)}
    return out


# ------------------------------------------------------------------------------- keras


def keras_model(seed: int = 0) -> Any:
    """The 8 -> 16 -> 3 tanh MLP in Keras, seeded."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, "tanh"),
                             keras.layers.Dense(CLASSES)])


def keras_optimizer(name: str, lr: float) -> Any:
    """``"sgd"``: SGD with momentum; ``"adam"``: Adam."""
    import keras

    if name == "sgd":
        return keras.optimizers.SGD(lr, momentum=MOMENTUM)
    return keras.optimizers.Adam(lr)


def keras_loss() -> Any:
    """Mean sparse categorical cross-entropy on logits."""
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def keras_plain(init: Weights, optimizer: str, lr: float,
                batches: Iterable[tuple[np.ndarray, np.ndarray]], loss_scale: float = 1.0
                ) -> Weights:
    """Plain Keras: a fresh model with weights ``init``, compiled with the same optimizer
    config, ``train_on_batch`` per batch. ``loss_scale`` multiplies the loss (a power of
    two: the gradients scale exactly)."""
    model = keras_model()
    model.set_weights(init)
    base = keras_loss()

    def scaled(y_true: Any, y_pred: Any) -> Any:
        return base(y_true, y_pred) * loss_scale

    model.compile(keras_optimizer(optimizer, lr), base if loss_scale == 1.0 else scaled)
    for x, y in batches:
        model.train_on_batch(x, y)
    return [np.asarray(w) for w in model.get_weights()]


def keras_run_job(cases: dict[str, dict]) -> dict[str, dict[str, Weights]]:
    """Each rank: for every case ``{"opt", "lr", "bpps", "fp16", "average"}``, ``model.fit``
    the seeded MLP with ``hvd.DistributedOptimizer`` on its ``BATCH`` rows of every
    global batch (``backward_passes_per_step=bpps``, ``average_aggregated_gradients``),
    with ``BroadcastGlobalVariablesCallback`` as Horovod scripts use it.
    Returns case -> ``{"init": weights, "final": weights}``."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import hvd_spark.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = dataset()
    steps = ROWS // (size * BATCH)
    mine = [rank_rows(s, rank, size, BATCH) for s in range(steps)]
    xs, ys = np.concatenate([x[r] for r in mine]), np.concatenate([y[r] for r in mine])
    out = {}
    for name, case in cases.items():
        model = keras_model()
        init = [np.asarray(w) for w in model.get_weights()]
        compression = hvd.Compression.fp16 if case.get("fp16") else hvd.Compression.none
        opt = hvd.DistributedOptimizer(
            keras_optimizer(case["opt"], case["lr"]), compression=compression,
            backward_passes_per_step=case.get("bpps", 1),
            average_aggregated_gradients=case.get("average", False))
        model.compile(opt, keras_loss())
        model.fit(xs, ys, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        out[name] = {"init": init, "final": [np.asarray(w) for w in model.get_weights()]}
    return out
