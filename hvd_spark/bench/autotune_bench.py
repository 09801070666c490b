"""Autotune on vs off: the same allreduce workload, alternating jobs, medians.

``python -m hvd_spark.bench autotune [-np N]`` launches N local ranks per job. Each round
runs one job with the configured parameters and one with ``HVD_SPARK_AUTOTUNE=1``; the
tuned job first trains until the tuner froze its choice (that phase is reported apart),
then both time the same steps. A step allreduces a gradient set tensor by tensor, as
``DistributedOptimizer``'s hooks do (ResNet-50's 161 tensors, 102 MB, by default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from hvd_spark.bench.allreduce import resnet50_shapes
from hvd_spark.bench.timing import parse_size

# Safety bound on the tuning phase (the tuner's own bound comes first).
_MAX_TUNING_STEPS = 5000


def _shapes(workload: str) -> list[tuple[int, ...]]:
    if workload == "resnet50":
        return resnet50_shapes()
    count, _, size = workload.partition("x")  # e.g. "200x64K": 200 tensors of 64 KiB
    return [(parse_size(size) // 4,)] * int(count)


def rank_main(opts: dict) -> dict:
    """One job on one rank: tune (when on), then time ``steps`` steps."""
    import hvd_spark.collectives as hvd
    from hvd_spark.collectives import _plumbing

    hvd.init()
    grads = [np.full(s, hvd.rank() + 1, np.float32) for s in _shapes(opts["workload"])]
    expect = sum(range(1, hvd.size() + 1))

    def step() -> None:
        handles = [hvd.allreduce_async(g, name=f"grad.{i}", op=hvd.Sum)
                   for i, g in enumerate(grads)]
        results = [hvd.synchronize(h) for h in handles]
        if results[0].reshape(-1)[0] != expect:
            raise AssertionError("wrong allreduce result")

    engine = _plumbing.current_engine()
    tuning_steps, start = 0, time.perf_counter()
    if opts["autotune"]:
        done = False
        while not done and tuning_steps < _MAX_TUNING_STEPS:
            step()
            tuning_steps += 1
            # Rank 0's tuner decides; every rank must stop at the same step.
            done = hvd.broadcast_object(not engine.autotuning, 0, name="bench.tuned")
    tuning_s = time.perf_counter() - start
    for _ in range(3):
        step()
    times = []
    for _ in range(opts["steps"]):
        hvd.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    slowest = hvd.allgather_object((statistics.median(times), min(times)))
    choice = engine.autotune_choice
    chosen = ((choice.fusion_threshold, choice.cycle_time_ms, choice.chunk_bytes)
              if choice is not None else
              (engine.config.fusion_threshold, engine.config.cycle_time_ms,
               engine.config.chunk_bytes))
    return {"step_s": max(t[0] for t in slowest), "best_s": max(t[1] for t in slowest),
            "tuning_steps": tuning_steps, "tuning_s": tuning_s,
            "chosen": chosen}


def _fmt_params(chosen) -> str:
    fusion, cycle, chunk = chosen
    chunk_text = "-" if chunk is None else f"{chunk >> 10} KiB"
    return f"fusion {fusion / (1 << 20):g} MiB, cycle {cycle:g} ms, chunk {chunk_text}"


def main(argv: list[str] | None = None) -> int:
    """Run the alternating rounds and print their table."""
    parser = argparse.ArgumentParser(prog="python -m hvd_spark.bench autotune",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("-np", "--num-proc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternating pairs of jobs")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per job")
    parser.add_argument("--workload", default="resnet50",
                        help="resnet50, or COUNTxSIZE (e.g. 200x64K) float32 tensors")
    parser.add_argument("--tcp", action="store_true", help="HVD_SPARK_DISABLE_SHM=1")
    parser.add_argument("--steps-per-sample", type=int, default=3)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--warmup-samples", type=int, default=2)
    parser.add_argument("--max-candidates", type=int, default=20,
                        help="1: measure the configured values only (the cost of tuning's "
                             "larger shared-memory slots, nothing tuned)")
    parser.add_argument("--log", default="", help="HVD_SPARK_AUTOTUNE_LOG of the tuned jobs")
    args = parser.parse_args(argv)

    from hvd_spark.runner import run_local

    base_env = {"HVD_SPARK_DISABLE_SHM": "1" if args.tcp else ""}
    tuned_env = {**base_env, "HVD_SPARK_AUTOTUNE": "1",
                 "HVD_SPARK_AUTOTUNE_STEPS_PER_SAMPLE": str(args.steps_per_sample),
                 "HVD_SPARK_AUTOTUNE_SAMPLES": str(args.samples),
                 "HVD_SPARK_AUTOTUNE_WARMUP_SAMPLES": str(args.warmup_samples),
                 "HVD_SPARK_AUTOTUNE_MAX_CANDIDATES": str(args.max_candidates)}
    rows: dict[str, list[dict]] = {"default": [], "autotune": []}
    for r in range(args.rounds):
        for label, env in (("default", base_env), ("autotune", tuned_env)):
            if label == "autotune" and args.log:
                root, ext = os.path.splitext(args.log)
                env = {**env, "HVD_SPARK_AUTOTUNE_LOG": f"{root}.{r}{ext or '.csv'}"}
            opts = {"autotune": label == "autotune", "steps": args.steps,
                    "workload": args.workload}
            out = run_local(rank_main, args=(opts,), num_proc=args.num_proc, env=env)[0]
            rows[label].append(out)
            print(f"round {r} {label:8s}: {1e3 * out['step_s']:7.1f} ms/step "
                  f"(fastest {1e3 * out['best_s']:6.1f})  "
                  f"({_fmt_params(out['chosen'])}"
                  + (f"; tuned in {out['tuning_steps']} steps, {out['tuning_s']:.1f} s)"
                     if label == "autotune" else ")"), flush=True)
    nbytes = sum(4 * int(np.prod(s)) for s in _shapes(args.workload))
    path = "TCP" if args.tcp else "shared memory"
    print(f"\n{args.workload} ({len(_shapes(args.workload))} tensors, {nbytes / 1e6:.1f} MB), "
          f"{args.num_proc} ranks, {path}; median of {args.rounds} alternating jobs, "
          f"each the median of {args.steps} steps")
    med = {k: statistics.median(o["step_s"] for o in v) for k, v in rows.items()}
    best = {k: statistics.median(o["best_s"] for o in v) for k, v in rows.items()}
    print("            median step  (fastest step: less exposed to other load)")
    print(f"  default   {1e3 * med['default']:7.1f} ms     ({1e3 * best['default']:6.1f} ms)")
    print(f"  autotune  {1e3 * med['autotune']:7.1f} ms     ({1e3 * best['autotune']:6.1f} ms)  "
          f"{med['default'] / med['autotune']:.2f}x ({best['default'] / best['autotune']:.2f}x), "
          f"tuning phase {statistics.median(o['tuning_s'] for o in rows['autotune']):.1f} s")
    for out in rows["autotune"]:
        print(f"    chose {_fmt_params(out['chosen'])}")
    return 0
