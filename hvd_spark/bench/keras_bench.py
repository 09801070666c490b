"""Keras ``model.fit`` throughput: hvd_spark DistributedOptimizer vs MWMS vs one process.

``python -m hvd_spark.bench keras [--np 2] [--batch 64] [--steps 20] [--warmup 3]
[--models mlp,conv] [--modes hvd_spark,mwms,single] [--threads 1] [--rounds 2]``

Each mode is one fresh job of local processes (``run_local``) training every model
with ``model.fit`` in its default compiled mode, on synthetic data, at the same
global batch:

- ``hvd_spark``: ``--np`` ranks, ``hvd.DistributedOptimizer``, ``global/np`` rows each.
- ``mwms``: ``--np`` workers of ``tf.distribute.MultiWorkerMirroredStrategy`` (gRPC
  ring on 127.0.0.1), the same global batch split by the strategy; Keras 3.15 needs
  a patch for this (see ``mwms_patch``), and the output says so.
- ``single``: one process fitting the global batch with ``np * threads`` threads.
- ``alone``: ``--np`` processes at once, each fitting ``global/np`` rows with a plain
  optimizer and no communication during the fit (a barrier starts the fits together; the
  slowest rank's rate counts): the ceiling of any data-parallel library on this machine
  (the ranks still share its cores and memory bandwidth).

Samples/s count global samples over the timed steps (after ``--warmup`` steps); the
modes run in turn ``--rounds`` times and each keeps its best round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

MODES = ("hvd_spark", "mwms", "single", "alone")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hvd_spark.bench keras", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="number of local ranks / workers")
    p.add_argument("--batch", type=int, default=64, help="global batch (all ranks together)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per model and mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--models", default="mlp,conv", help="comma-separated: mlp, conv")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ",".join(MODES))
    p.add_argument("--threads", type=int, default=1, help="TF intra-op threads per rank")
    p.add_argument("--rounds", type=int, default=2,
                   help="run the modes in turn this many times; each mode's best round counts")
    return p.parse_args(argv)


def _build(kind: str):
    """A compiled-ready Keras model and its input shape."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(0)
    if kind == "mlp":  # 1024*4096 + 4096*4096 + 4096*1024 + 1024*10 + biases ~= 25.2M
        return keras.Sequential([
            keras.Input((1024,)), layers.Dense(4096, activation="relu"),
            layers.Dense(4096, activation="relu"), layers.Dense(1024, activation="relu"),
            layers.Dense(10)]), (1024,)

    def block(x, filters: int, stride: int):
        y = layers.Conv2D(filters, 3, stride, padding="same", use_bias=False)(x)
        y = layers.ReLU()(layers.BatchNormalization()(y))
        y = layers.BatchNormalization()(
            layers.Conv2D(filters, 3, padding="same", use_bias=False)(y))
        if stride != 1 or x.shape[-1] != filters:
            x = layers.BatchNormalization()(
                layers.Conv2D(filters, 1, stride, use_bias=False)(x))
        return layers.ReLU()(layers.Add()([x, y]))

    inputs = keras.Input((32, 32, 3))
    x = layers.ReLU()(layers.BatchNormalization()(
        layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)))
    for filters, stride in ((16, 1), (32, 2), (64, 2)):
        x = block(x, filters, stride)
    outputs = layers.Dense(10)(layers.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, outputs), (32, 32, 3)


def _worker(mode: str, models: list[str], global_batch: int, steps: int, warmup: int,
            threads: int, ports: list[int]) -> dict:
    """One rank of one mode: fit every model, return samples/s per model."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    rank = int(os.environ.get("HVD_SPARK_RANK", "0"))
    if mode == "mwms":
        os.environ["TF_CONFIG"] = json.dumps({
            "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
            "task": {"type": "worker", "index": rank}})
    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    strategy = None
    if mode == "mwms":
        from hvd_spark.bench import mwms_patch

        mwms_patch.apply()
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    elif mode in ("hvd_spark", "alone"):
        import hvd_spark.tensorflow as hvd

        hvd.init()  # alone: only so that the ranks start each fit together
    size = len(ports) if mode != "single" else 1
    local_batch = global_batch // size if mode in ("hvd_spark", "alone") else global_batch
    out: dict[str, Any] = {"rank": rank, "params": {}, "samples_per_s": {}}
    for kind in models:
        scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
        with scope:
            model, shape = _build(kind)
            optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
            if mode == "hvd_spark":
                optimizer = hvd.DistributedOptimizer(optimizer)
            model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rng = np.random.default_rng(rank)
        x = rng.normal(size=(local_batch * 4,) + shape).astype("float32")
        y = rng.integers(0, 10, size=(local_batch * 4,)).astype("int32")
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(local_batch).repeat()
        if strategy is not None:  # every worker sees full global batches, split per replica
            options = tf.data.Options()
            options.experimental_distribute.auto_shard_policy = (
                tf.data.experimental.AutoShardPolicy.OFF)
            data = data.with_options(options)
        stamps: list[float] = []
        timer = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs, s=stamps: s.append(time.perf_counter()))
        callbacks = [timer]
        if mode == "hvd_spark":
            callbacks.insert(0, hvd.callbacks.BroadcastGlobalVariablesCallback(0))
        if mode == "alone":
            hvd.barrier()
        model.fit(data, steps_per_epoch=warmup + steps, epochs=1, verbose=0, shuffle=False,
                  callbacks=callbacks)
        elapsed = stamps[-1] - stamps[warmup - 1]
        out["params"][kind] = int(model.count_params())
        out["samples_per_s"][kind] = steps * global_batch / elapsed
    return out


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _run_mode(mode: str, args: argparse.Namespace, models: list[str]) -> dict:
    from hvd_spark.runner.local.local_launcher import run_local

    num_proc = 1 if mode == "single" else args.np
    threads = args.threads * args.np if mode == "single" else args.threads
    env = {"TF_CPP_MIN_LOG_LEVEL": "3"}
    started = time.perf_counter()
    results = run_local(
        _worker, args=(mode, models, args.batch, args.steps, args.warmup, threads,
                       _free_ports(num_proc)),
        num_proc=num_proc, env=env)
    res = results[0]
    if mode == "alone":  # the slowest rank's rate (no step waits for the other ranks)
        for kind in res["samples_per_s"]:
            res["samples_per_s"][kind] = min(r["samples_per_s"][kind] for r in results)
    res["wall_s"] = time.perf_counter() - started
    return res


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its table; returns the exit code."""
    args = _parse(argv)
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES] + [m for m in models if m not in ("mlp", "conv")]
    if unknown or args.batch % args.np or args.warmup < 1:
        print(f"bad arguments: unknown {unknown}, or --batch not divisible by --np, "
              "or --warmup < 1")
        return 2
    print(f"Keras model.fit throughput, {args.np} local ranks, global batch {args.batch}, "
          f"{args.steps} timed steps after {args.warmup} warmup, {args.threads} TF thread(s) "
          f"per rank (single process: {args.np * args.threads})")
    if "mwms" in modes:
        from hvd_spark.bench import mwms_patch

        print(f"NOTE: {mwms_patch.DESCRIPTION}")
    results: dict[str, dict] = {}
    failed: set[str] = set()
    for _ in range(max(1, args.rounds)):  # alternating evens out a shared machine's load
        for mode in modes:
            if mode in failed:
                continue
            try:
                res = _run_mode(mode, args, models)
            except Exception as exc:  # noqa: BLE001 - report the failing mode, keep the others
                print(f"mode {mode} failed: {type(exc).__name__}: {str(exc)[:2000]}")
                failed.add(mode)
                continue
            best = results.setdefault(mode, res)
            for kind, rate in res["samples_per_s"].items():
                best["samples_per_s"][kind] = max(best["samples_per_s"][kind], rate)
    _print_table(results, models)
    return 0 if "hvd_spark" in results else 1


def _print_table(results: dict[str, dict], models: list[str]) -> None:
    header = f"{'model':6s} {'params':>8s} {'mode':10s} {'samples/s':>10s} {'vs mwms':>8s} " \
             f"{'vs single':>9s}"
    print(header)
    print("-" * len(header))
    for kind in models:
        for mode, res in results.items():
            rate = res["samples_per_s"][kind]
            ratio = {}
            for other in ("mwms", "single"):  # (alone is a ceiling, not a peer)
                base = results.get(other, {}).get("samples_per_s", {}).get(kind)
                ratio[other] = f"{rate / base:.2f}x" if base else "-"
            print(f"{kind:6s} {res['params'][kind] / 1e6:7.1f}M {mode:10s} {rate:10.1f} "
                  f"{ratio['mwms']:>8s} {ratio['single']:>9s}")
