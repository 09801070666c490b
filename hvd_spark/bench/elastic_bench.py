"""``python -m hvd_spark.bench elastic``: what elastic training costs.

1. Recovery: local elastic jobs of 3 workers run a small numpy training loop; the
   benchmark kills worker 1 (SIGKILL: the ring's sockets reset; SIGSTOP: only the
   heartbeat notices) and measures the time from the signal to the first training step of
   the re-formed ring, median over ``--repeats`` runs.
2. Commit: 2 ranks train a 25M-parameter torch MLP with ``DistributedOptimizer``; rounds
   without commits and with ``state.commit()`` every ``--commit-every`` steps alternate,
   and the table gives the step time of each, the commit's own time, and the overhead.
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import sys
import threading
import time

from hvd_spark.runner.elastic.elastic_driver import ElasticSettings
from hvd_spark.runner.elastic.elastic_local import ElasticLocalJob, run_elastic_local

_LOOP = r"""
import os, sys, time
import numpy as np
import hvd_spark.collectives as hvd
hvd.init()
state = hvd.elastic.ObjectState(step=0)
@hvd.elastic.run
def train(state):
    while state.step < int(sys.argv[1]):
        hvd.allreduce(np.ones(1024, np.float32), name="grad")
        state.step += 1
        print(f"step {state.step} gen {hvd.elastic.membership().generation} t {time.time():.6f}",
              flush=True)
        if state.step % 5 == 0:
            state.commit()
        time.sleep(0.02)
train(state)
"""
_LINE = re.compile(r"^\[(\d+)\] step (\d+) gen (\d+) t ([\d.]+)")


class _Watcher:
    """Output stream that signals worker 1 at ``kill_step`` and notes when gen 2 steps."""

    def __init__(self, kill_step: int, sig: int) -> None:
        self.job: ElasticLocalJob | None = None
        self.kill_step, self.sig = kill_step, sig
        self.killed_at: float | None = None
        self.resumed_at: float | None = None
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            for line in text.splitlines():
                match = _LINE.match(line)
                if not match:
                    continue
                worker, step, gen, stamp = match.groups()
                if worker == "1" and int(step) == self.kill_step and self.killed_at is None:
                    self.killed_at = time.time()
                    assert self.job is not None
                    self.job.procs["1"].send_signal(self.sig)
                if int(gen) >= 2 and self.resumed_at is None:
                    self.resumed_at = float(stamp)
        return len(text)

    def flush(self) -> None:
        pass


def recovery_seconds(sig: int, heartbeat_s: float) -> float:
    """Seconds from signalling worker 1 to the re-formed ring's first step."""
    import os

    settings = ElasticSettings(num_proc=3, min_np=2, max_np=3, start_timeout=120,
                               elastic_timeout=60, heartbeat_s=heartbeat_s)
    command = [sys.executable, "-c", _LOOP, "150"]
    env = {"HVD_SPARK_HEARTBEAT_S": str(heartbeat_s)}
    watcher = _Watcher(kill_step=40, sig=sig)
    with open(os.devnull, "w") as sink:
        with ElasticLocalJob(settings, env, cooldown=None, stdout=watcher, stderr=sink) as job:
            watcher.job = job
            job.start(command)
            if job.watch():
                raise RuntimeError("a worker of the recovery benchmark failed")
    if watcher.killed_at is None or watcher.resumed_at is None:
        raise RuntimeError("the run did not reach the kill or did not resume")
    return watcher.resumed_at - watcher.killed_at


def _commit_rank(steps: int, commit_every: int, rounds: int, hidden: int) -> dict:
    import time

    import torch

    import hvd_spark.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    x, y = torch.randn(32, hidden), torch.randint(0, 10, (32,))
    timings: dict[str, list[float]] = {"plain": [], "commit": [], "commit_only": []}

    def one_round(commit: bool) -> float:
        start = time.perf_counter()
        for step in range(1, steps + 1):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if commit and step % commit_every == 0:
                began = time.perf_counter()
                state.commit()
                timings["commit_only"].append(time.perf_counter() - began)
        return (time.perf_counter() - start) / steps

    one_round(False)  # warm-up
    for _ in range(rounds):
        timings["plain"].append(one_round(False))
        timings["commit"].append(one_round(True))
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, **{k: statistics.median(v) for k, v in timings.items()}}


def main(argv: list[str] | None = None) -> int:
    """Run both parts and print their tables."""
    parser = argparse.ArgumentParser(prog="python -m hvd_spark.bench elastic",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="recovery runs per signal")
    parser.add_argument("--heartbeat", type=float, default=3.0,
                        help="HVD_SPARK_HEARTBEAT_S for the SIGSTOP case (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="steps per commit round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=4900,
                        help="MLP width (4900: 24.1M parameters)")
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--skip-commit", action="store_true")
    args = parser.parse_args(argv)
    if not args.skip_recovery:
        print("recovery: 3 local workers, worker 1 signalled at step 40 "
              f"(median of {args.repeats})")
        print("| signal | detected by | kill -> first step of the new ring (s) |\n|---|---|---|")
        for sig, how in ((signal.SIGKILL, "socket reset"),
                         (signal.SIGSTOP, f"heartbeat ({args.heartbeat:g} s)")):
            times = [recovery_seconds(sig, args.heartbeat) for _ in range(args.repeats)]
            print(f"| {sig.name} | {how} | {statistics.median(times):.2f} "
                  f"(runs: {', '.join(f'{t:.2f}' for t in times)}) |")
    if not args.skip_commit:
        result = run_elastic_local(_commit_rank, args=(args.steps, args.commit_every,
                                                       args.rounds, args.hidden),
                                   num_proc=2, cooldown=None, start_timeout=300)[0]
        measured = result["commit"] / result["plain"] - 1
        share = result["commit_only"] / args.commit_every / result["plain"]
        print(f"\ncommit: 2 ranks, {result['params'] / 1e6:.1f}M-parameter MLP, SGD momentum, "
              f"commit every {args.commit_every} steps (medians of {args.rounds} rounds)")
        print("| step, no commit (ms) | step, with commits (ms) | one commit (ms) | "
              "commit per step / step | rounds' difference (noisy) |")
        print("|---|---|---|---|---|")
        print(f"| {result['plain'] * 1e3:.1f} | {result['commit'] * 1e3:.1f} | "
              f"{result['commit_only'] * 1e3:.1f} | {share * 100:.1f}% | {measured * 100:+.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
