"""Convergence: the same model and data trained plainly (one process) and by each Estimator.

``python -m hvd_spark.bench convergence [--frameworks torch,keras,lightning] [--seeds 3]
[--epochs 30] [--batch-size 64] [--lr 0.01] [--plain-threads 1] [--out DIR] [--quick]``

scikit-learn's handwritten digits (1,797 8x8 images, shipped with the package) are
upscaled to 28x28 (each pixel a 3x3 block, padded by 2 as MNIST pads its digits) and
scaled to [0, 1]; a fixed quarter is held out. For each framework and seed, one model
(the same initial weights for both runs) is trained

- plainly, in this process, at a global batch of ``num_proc * batch_size`` rows, and
- by the framework's Estimator (TorchEstimator, KerasEstimator, LightningEstimator) on
  ``num_proc`` = 2 Spark ranks of ``batch_size`` rows each: the same global batch.

Learning rates follow Horovod's rule: TorchEstimator and KerasEstimator step each rank
with ``lr * num_proc`` (``scale_learning_rate``), so their plain runs use that rate;
LightningEstimator does not scale, so its plain run uses ``lr``. The table gives each
run's rate per step and global batch, the final epoch's mean training loss and the
held-out accuracy (the Estimators' through the fitted Model's ``transform``, the plain
models' directly, on the same rows) as mean (min-max) over the seeds, and the wall
time (plain: the training loop; Estimator: ``fit``, which also writes the data to the
store and starts the ranks). A PNG of the learning curves (mean training loss per
epoch, mean and min-max band over the seeds) goes to ``--out``.

The default of 30 epochs: at a global batch of 128 the 1,348 training images make 10
steps an epoch, and Horovod's network at lr 0.02 is still on its initial plateau after
12 epochs (loss ~2.28, accuracy ~0.3); after 30 (300 steps) it is past it (~0.9). The
whole benchmark then took 7 minutes on a shared 2-core machine. The plain torch and Lightning
runs use one torch thread (``--plain-threads``), as each rank does.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvd_spark.bench.convergence_frameworks import (
    FRAMEWORKS,
    SIDE,
    Digits,
    Framework,
    Plan,
    estimator_lr,
)

NUM_PROC = 2
DEFAULT_EPOCHS = 30
QUICK_TRAIN_ROWS, QUICK_TEST_ROWS, QUICK_EPOCHS = 512, 128, 2


@dataclass
class Run:
    """One training run: a framework's plain loop or Estimator, for one seed."""

    framework: str
    kind: str  # "plain" or "estimator"
    seed: int
    global_batch: int
    lr: float  # per optimizer step
    losses: list[float]
    accuracy: float
    wall_s: float


def load_digits_28(test_fraction: float = 0.25, train_rows: int | None = None,
                   test_rows: int | None = None) -> Digits:
    """scikit-learn's digits upscaled to ``SIDE`` x ``SIDE``, in [0, 1], split once.

    Args:
        test_fraction: The share of images held out (the same rows for every run).
        train_rows: Keep only this many training images (``--quick``).
        test_rows: Keep only this many held-out images (``--quick``).
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    scale = 3  # 8x8 -> 24x24, then padded to 28x28
    pad = (SIDE - 8 * scale) // 2
    images = np.kron(digits.images / 16.0, np.ones((1, scale, scale)))
    images = np.pad(images, ((0, 0), (pad, pad), (pad, pad)))
    x = images.reshape(len(images), SIDE * SIDE)
    y = digits.target.astype(np.int64)
    # A fixed split (seed 0), so every framework and seed is scored on the same rows.
    order = np.random.default_rng(0).permutation(len(x))
    cut = int(len(x) * test_fraction)
    test, train = order[:cut][:test_rows], order[cut:][:train_rows]
    return Digits(x[train], y[train], x[test], y[test])


def _frames(spark: Any, data: Digits) -> tuple[Any, Any]:
    """The train and test rows as DataFrames of ``features array<double>, label long``."""
    schema = "features array<double>, label long"

    def frame(x: np.ndarray, y: np.ndarray) -> Any:
        return spark.createDataFrame([(row.tolist(), int(v)) for row, v in zip(x, y)], schema)

    return frame(data.x_train, data.y_train), frame(data.x_test, data.y_test)


def _session(master: str) -> tuple[Any, bool]:
    """The active SparkSession (a test's, say) or a new one on ``master``; and whether
    this call created it (then ``main`` stops it)."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # fewer TensorFlow logs from the ranks
    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    spark = (SparkSession.builder.master(master).appName("hvd_spark-bench-convergence")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.python.worker.reuse", "true")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark, True


def _transform_accuracy(fitted: Any, test_df: Any) -> float:
    rows = fitted.transform(test_df).select("label", "label__output").collect()
    return float(np.mean([int(np.argmax(r["label__output"])) == r["label"] for r in rows]))


def run_seed(framework: Framework, plan: Plan, data: Digits, train_df: Any,
             test_df: Any) -> list[Run]:
    """Train ``framework``'s model plainly and by its Estimator for one seed."""
    store = tempfile.mkdtemp(prefix="hvd_spark_convergence_")
    try:
        estimator = framework.estimator(plan, store)
        lr = estimator_lr(estimator, plan)  # the plain run steps with what each rank uses
        plain = framework.plain(data, plan, lr)
        start = time.perf_counter()
        fitted = estimator.fit(train_df)
        wall = time.perf_counter() - start
        accuracy = _transform_accuracy(fitted, test_df)
        curve = framework.curve(fitted)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    common = {"framework": framework.name, "seed": plan.seed,
              "global_batch": plan.global_batch, "lr": lr}
    return [Run(kind="plain", losses=plain.losses, accuracy=plain.accuracy,
                wall_s=plain.wall_s, **common),
            Run(kind="estimator", losses=curve, accuracy=accuracy, wall_s=wall, **common)]


def _spread(values: list[float], digits: int) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _lr_note(kind: str, lr: float, given: float) -> str:
    if kind == "plain":
        return f"{lr:g}"
    if math.isclose(lr, given):
        return f"{lr:g} (not scaled)"
    return f"{lr:g} ({given:g} x {NUM_PROC} ranks)"


def _rule(runs: list[Run], given_lr: float) -> str:
    """Which Estimators scaled the learning rate by the ranks (Horovod's rule), which not."""
    names = {r.framework: FRAMEWORKS[r.framework].estimator_name for r in runs}
    scaled = [n for f, n in names.items()
              if any(not math.isclose(r.lr, given_lr) for r in runs if r.framework == f)]
    kept = [n for n in names.values() if n not in scaled]
    parts = []
    if scaled:
        verb = "scales" if len(scaled) == 1 else "scale"
        parts.append(f"{' and '.join(scaled)} {verb} it by the ranks (Horovod's rule)")
    if kept:
        parts.append(f"{' and '.join(kept)} {'keeps' if len(kept) == 1 else 'keep'} it as given")
    return "; ".join(parts)


def table(runs: list[Run], given_lr: float) -> list[str]:
    """Markdown rows, one per framework and kind of run, over the seeds."""
    head = ["| framework | run | global batch | lr per step | final train loss mean (min-max) "
            "| test accuracy mean (min-max) | wall s mean |",
            "|---|---|---:|---|---|---|---:|"]
    rows = []
    for framework in dict.fromkeys(r.framework for r in runs):
        for kind in ("plain", "estimator"):
            group = [r for r in runs if r.framework == framework and r.kind == kind]
            run = ("plain, 1 process" if kind == "plain"
                   else f"{FRAMEWORKS[framework].estimator_name}, {NUM_PROC} ranks")
            rows.append(
                f"| {framework} | {run} | {group[0].global_batch} "
                f"| {_lr_note(kind, group[0].lr, given_lr)} "
                f"| {_spread([r.losses[-1] for r in group], 4)} "
                f"| {_spread([r.accuracy for r in group], 3)} "
                f"| {statistics.fmean(r.wall_s for r in group):.1f} |")
    return head + rows


def gaps(runs: list[Run]) -> list[str]:
    """Per framework: the Estimator's mean accuracy and final loss minus the plain run's."""
    lines = []
    for framework in dict.fromkeys(r.framework for r in runs):
        mean = {kind: (statistics.fmean(r.accuracy for r in runs
                                        if r.framework == framework and r.kind == kind),
                       statistics.fmean(r.losses[-1] for r in runs
                                        if r.framework == framework and r.kind == kind))
                for kind in ("plain", "estimator")}
        lines.append(f"{framework}: estimator - plain: accuracy "
                     f"{mean['estimator'][0] - mean['plain'][0]:+.3f}, final train loss "
                     f"{mean['estimator'][1] - mean['plain'][1]:+.4f}")
    return lines


def plot(runs: list[Run], path: str) -> None:
    """Learning curves: one panel per framework, plain and Estimator, mean and min-max."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    frameworks = list(dict.fromkeys(r.framework for r in runs))
    # The Agg canvas directly, not pyplot: no global backend switch in the caller's process.
    fig = Figure(figsize=(5 * len(frameworks), 4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(frameworks), squeeze=False)[0]
    for ax, framework in zip(axes, frameworks):
        for kind, color in (("plain", "tab:blue"), ("estimator", "tab:orange")):
            group = [r for r in runs if r.framework == framework and r.kind == kind]
            curves = np.array([r.losses for r in group])
            epochs = np.arange(1, curves.shape[1] + 1)
            label = ("plain, 1 process" if kind == "plain"
                     else f"{FRAMEWORKS[framework].estimator_name}, {NUM_PROC} ranks")
            ax.plot(epochs, curves.mean(axis=0), color=color, marker="o", markersize=3,
                    label=f"{label} (lr {group[0].lr:g})")
            ax.fill_between(epochs, curves.min(axis=0), curves.max(axis=0), color=color,
                            alpha=0.2)
        ax.set_title(f"{framework}: global batch {group[0].global_batch}, {len(group)} seed(s)")
        ax.set_xlabel("epoch")
        ax.set_ylabel("mean training loss")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=100)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hvd_spark.bench convergence",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                        help="comma-separated, of: " + ", ".join(FRAMEWORKS))
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds 0..N-1 (default 3; --quick: 1)")
    parser.add_argument("--epochs", type=int, default=None,
                        help=f"epochs (default {DEFAULT_EPOCHS}; --quick: {QUICK_EPOCHS})")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="rows per rank and step (the plain run: x 2)")
    parser.add_argument("--lr", type=float, default=0.01,
                        help="learning rate given to each Estimator's optimizer")
    parser.add_argument("--plain-threads", type=int, default=1,
                        help="torch threads of the plain torch/Lightning runs (each rank "
                             "gets spark.task.cpus = 1 by default)")
    parser.add_argument("--out", default=".", help="directory for convergence.png")
    parser.add_argument("--master", default=f"local[{NUM_PROC}]",
                        help="Spark master when no session is active")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: 1 seed, {QUICK_EPOCHS} epochs, {QUICK_TRAIN_ROWS} "
                             f"training and {QUICK_TEST_ROWS} test images")
    args = parser.parse_args(argv)
    args.frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = [f for f in args.frameworks if f not in FRAMEWORKS]
    if unknown or not args.frameworks:
        parser.error(f"--frameworks: unknown {unknown}; choose from {', '.join(FRAMEWORKS)}")
    if args.seeds is None:
        args.seeds = 1 if args.quick else 3
    if args.epochs is None:
        args.epochs = QUICK_EPOCHS if args.quick else DEFAULT_EPOCHS
    if min(args.seeds, args.epochs, args.batch_size, args.plain_threads) < 1 or args.lr <= 0:
        parser.error("--seeds, --epochs, --batch-size and --plain-threads must be >= 1 and "
                     "--lr > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, write the plot; 1 if a number is not finite."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    data = (load_digits_28(train_rows=QUICK_TRAIN_ROWS, test_rows=QUICK_TEST_ROWS)
            if args.quick else load_digits_28())
    spark, created = _session(args.master)
    started = time.perf_counter()
    runs: list[Run] = []
    try:
        train_df, test_df = _frames(spark, data)
        for name in args.frameworks:
            for seed in range(args.seeds):
                plan = Plan(epochs=args.epochs, batch_size=args.batch_size, num_proc=NUM_PROC,
                            lr=args.lr, seed=seed, plain_threads=args.plain_threads)
                runs.extend(run_seed(FRAMEWORKS[name], plan, data, train_df, test_df))
    finally:
        if created:
            spark.stop()
    models = "; ".join(f"{n}: {FRAMEWORKS[n].model}" for n in args.frameworks)
    print(f"convergence: plain (1 process, {args.plain_threads} torch thread(s), batch "
          f"{NUM_PROC * args.batch_size}) vs Estimator "
          f"({NUM_PROC} ranks x batch {args.batch_size}), the same global batch and initial "
          f"weights; digits 8x8 -> {SIDE}x{SIDE}, {len(data.y_train)} train / "
          f"{len(data.y_test)} held-out images; {args.epochs} epochs; seeds "
          f"0-{args.seeds - 1}; lr {args.lr:g} given to each Estimator; {_rule(runs, args.lr)}; "
          "each plain run steps with its Estimator's rate per rank")
    print(f"models: {models}")
    print()
    print("\n".join(table(runs, args.lr)))
    print()
    print("\n".join(gaps(runs)))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "convergence.png")
    plot(runs, path)
    print(f"learning curves: {path}; total {time.perf_counter() - started:.0f} s "
          "(Estimator wall: fit, with writing the data and starting the ranks)")
    finite = all(math.isfinite(v) for r in runs for v in (*r.losses, r.accuracy, r.wall_s))
    return 0 if finite and all(r.losses for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
