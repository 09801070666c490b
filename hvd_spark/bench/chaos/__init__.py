"""``python -m hvd_spark.bench chaos``: a workload on namespace hosts under seeded faults.

``--hosts 3 --faults N --seed S --workload fit|elastic|distributor [--deadline SECONDS]``

Builds a Spark standalone cluster of namespace hosts (``netns_cluster``; root and a
source checkout), runs the workload and injects N faults at seeded random steps and
places: an executor JVM killed, a rank SIGKILLed, a rank SIGSTOPped for 20 s, a host's
link down for 5 s, 5 % loss and 50 ms delay for 10 s (``tc netem``; a 1 Mbit/s link
where the kernel has no netem), /dev/shm filled on one host, or one of these while the
cluster recovers from the previous fault. Prints one row per fault, then the checks:
the fit's weights equal a fault-free fit's, the elastic loop's state is the same on
every rank at its last step, a DDP job ends with a named error and nothing running,
nothing is left on any host, and the soak ends before its deadline.
"""

from __future__ import annotations

import argparse
import signal

from hvd_spark.bench.multihost_allreduce import namespace_hosts


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options of the chaos soak."""
    from hvd_spark.bench.chaos.faults import KINDS
    from hvd_spark.bench.chaos.workloads import WORKLOADS

    p = argparse.ArgumentParser(prog="python -m hvd_spark.bench chaos")
    p.add_argument("--hosts", type=int, default=3, help="namespace hosts, one rank each")
    p.add_argument("--faults", type=int, default=5, help="faults to inject")
    p.add_argument("--seed", type=int, default=0, help="seed of the faults' kinds, times "
                   "and places")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="fit")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help="comma-separated fault kinds to draw from (default: all)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds the soak may take (default: 240 + 90 per fault)")
    args = p.parse_args(argv)
    if args.hosts != 3:
        p.error("--hosts: the workloads run 3 ranks, one per host: use --hosts 3")
    if args.faults < 1:
        p.error("--faults must be at least 1")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        p.error(f"--kinds: unknown {unknown or 'none given'}; known: {', '.join(KINDS)}")
    args.kinds = kinds
    if args.deadline is None:
        args.deadline = 240.0 + 90.0 * args.faults
    return args


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    """Build the cluster, soak, print the table and the checks; 1 when a check failed."""
    args = parse_args(argv)
    harness = namespace_hosts()
    why = harness.problem()
    if why:
        raise SystemExit(f"chaos needs namespace hosts: {why}")
    from hvd_spark.bench.chaos import report
    from hvd_spark.bench.chaos.soak import SPARK_CONF, soak
    from netns_cluster.services import spark_cluster

    # A SIGTERM (``timeout``, a CI runner) unwinds like an error, so the cluster's daemons
    # and namespaces are removed: killed outright, the Spark daemons would outlive us.
    signal.signal(signal.SIGTERM, _terminated)
    with spark_cluster(args.hosts, cores=1, conf=SPARK_CONF) as (net, spark):
        result = soak(net, spark, args.workload, args.faults, args.seed, args.deadline,
                      args.kinds)
    for line in report.table(result.rows):
        print(line)
    for note in result.notes:
        print(f"note: {note}")
    for problem in result.problems:
        print(f"FAILED: {problem}")
    print(f"chaos {args.workload}: {len(result.rows)} faults in {result.seconds:.0f} s: "
          + ("every check passed" if not result.problems else
             f"{len(result.problems)} check(s) failed"))
    return 1 if result.problems else 0
