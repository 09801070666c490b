"""Timeline overhead: the same training steps with the timeline off and on.

``python -m hvd_spark.bench timeline [-np 2] [--rounds 7] [--steps 20]`` runs, on local
ranks, two workloads and alternates rounds with the timeline off and on (started and
stopped on every rank through ``start_timeline``/``stop_timeline``, as a user would):

- ``torch``: a 12-layer torch MLP (25 gradient tensors, 3.2M parameters) stepping
  through ``hvd_spark.torch.DistributedOptimizer``: what training pays;
- ``small``: 64 asynchronous 1 KB allreduces per step: the worst case, where a step is
  nothing but negotiations and each one writes several timeline events.

Each figure is the median over rounds of the slowest rank's mean step time; the
overhead is on/off - 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from hvd_spark.runner.local.local_launcher import run_local

_WORKLOADS = ("torch", "small")


def _torch_step():
    import torch

    import hvd_spark.torch as hvd

    torch.manual_seed(0)
    layers: list = []
    for _ in range(12):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def _small_step():
    import numpy as np

    import hvd_spark.collectives as hvd

    arrays = [np.ones(256, np.float32) for _ in range(64)]

    def step() -> None:
        handles = [hvd.allreduce_async(a, name=f"small.{i}", op=hvd.Sum)
                   for i, a in enumerate(arrays)]
        for h in handles:
            hvd.synchronize(h)

    return step


def _rank(workloads: list[str], rounds: int, steps: int, directory: str) -> dict:
    import torch

    import hvd_spark.collectives as hvd

    torch.set_num_threads(1)
    hvd.init()
    out: dict = {}
    for name in workloads:
        step = _torch_step() if name == "torch" else _small_step()
        for _ in range(3):
            step()  # warm-up
        times: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(rounds):
            for state in ("off", "on") if r % 2 == 0 else ("on", "off"):
                if state == "on":
                    hvd.start_timeline(os.path.join(directory, f"{name}-{r}.json"))
                hvd.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                times[state].append((time.perf_counter() - start) / steps)
                if state == "on":
                    hvd.stop_timeline()
        out[name] = times
    return out


def main(argv: list[str] | None = None) -> int:
    """Run on local ranks and print the table."""
    parser = argparse.ArgumentParser(prog="python -m hvd_spark.bench timeline",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("-np", "--num-proc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7, help="rounds per state (odd)")
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--workloads", default=",".join(_WORKLOADS),
                        help=f"comma list of {_WORKLOADS}")
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(workloads) - set(_WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {_WORKLOADS}")
    with tempfile.TemporaryDirectory(prefix="hvd_timeline_bench_") as directory:
        results = run_local(_rank, args=(workloads, args.rounds, args.steps, directory),
                            num_proc=args.num_proc)
        sizes = {w: sum(os.path.getsize(os.path.join(directory, f))
                        for f in os.listdir(directory) if f.startswith(w)) for w in workloads}
    print(f"{args.num_proc} ranks, {args.steps} steps per round, medians of {args.rounds} "
          "alternating rounds (slowest rank)")
    print("| workload | off (ms/step) | on (ms/step) | overhead | timeline bytes/step |")
    print("|---|---|---|---|---|")
    for name in workloads:
        per_round = {state: [max(r[name][state][i] for r in results)
                             for i in range(args.rounds)] for state in ("off", "on")}
        off, on = (statistics.median(per_round[s]) for s in ("off", "on"))
        per_step = sizes[name] / (args.rounds * args.steps)
        print(f"| {name} | {off * 1e3:.2f} | {on * 1e3:.2f} | {on / off - 1:+.1%} | "
              f"{per_step:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
