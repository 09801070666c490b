"""``python -m hvd_spark.bench scaling``: predicted data-parallel efficiency on many hosts.

An alpha-beta model of the two all-reduce schedules, with alpha (seconds per ring step)
and beta (the link's bytes per second) measured on namespace hosts (``netns_cluster.hosts``):

- flat ring of N = H x L ranks: every host's link carries one ring edge each way, so
  T = 2(N-1) alpha + 2(N-1)/N x S / B;
- hierarchical (L cross rings, one per local rank, each with 1/L of the buffer; the
  shared-memory phases overlap the network's): T = 2(H-1) alpha + 2(H-1)/H x S / B
  + one pipeline block's local phases.

The model is first checked against the harness itself (2x2 and 3x2 hosts, both
schedules), then used for ResNet-50- and VGG-16-sized gradient sets on 8-512 hosts:
efficiency = compute / (compute + exposed communication), between "no overlap" (every
byte after the backward pass) and "full overlap" (communication hidden up to the compute
time), next to Horovod's published figures. Needs root and a source checkout (the
namespace harness is test support, not part of the wheel).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from hvd_spark.bench.multihost_allreduce import launch, namespace_hosts

if TYPE_CHECKING:
    from netns_cluster.hosts import LinkShape, NetnsHosts

RESNET50_BYTES = 25_557_032 * 4
VGG16_BYTES = 138_357_544 * 4
HOST_COUNTS = (8, 32, 128, 512)
_PUBLISHED = ("Horovod's published scaling (Sergeev & Del Balso 2018, 128 servers x 4 P100, "
              "25 Gbit/s RoCE): 90% for Inception V3 and ResNet-101, 68% for VGG-16 at 512 GPUs")
_BLOCK = 4 << 20


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """alpha: seconds per ring step; bandwidth: bytes per second of a host's link."""

    alpha: float
    bandwidth: float

    def flat(self, nbytes: int, hosts: int, per_host: int) -> float:
        n = hosts * per_host
        return 2 * (n - 1) * self.alpha + 2 * (n - 1) / n * nbytes / self.bandwidth

    def hierarchical(self, nbytes: int, hosts: int, per_host: int, local_bw: float) -> float:
        fill = 2 * (per_host - 1) / per_host * min(nbytes, _BLOCK) / local_bw
        return (2 * (hosts - 1) * self.alpha + 2 * (hosts - 1) / hosts * nbytes / self.bandwidth
                + fill)


def efficiency(compute: float, comm: float) -> tuple[float, float]:
    """(no overlap, full overlap) scaling efficiency of a step."""
    return compute / (compute + comm), compute / max(compute, comm)


def _time(net: NetnsHosts, per_host: int, hierarchical: bool, sizes: list[int]) -> dict:
    env = {"HVD_SPARK_HIERARCHICAL_ALLREDUCE": "1" if hierarchical else "0"}
    opts = {"sizes": sizes, "budget": 200e6, "rounds": 2, "gloo": False}
    result = launch(net, per_host, env, opts)
    return {row["bytes"]: row["hvd"] for row in result["rows"]}


def calibrate(shape: LinkShape) -> LinkModel:
    """alpha and the link's bandwidth from 2 hosts x 1 rank (a 2-rank ring: 2 steps)."""
    small, large = 4096, 64 << 20
    with namespace_hosts().NetnsHosts(2, shape) as net:
        t = _time(net, 1, False, [small, large])
    alpha = t[small] / 2
    return LinkModel(alpha, large / max(1e-9, t[large] - 2 * alpha))


def validate(model: LinkModel, shape: LinkShape, local_bw: float) -> list[dict]:
    """Measured vs predicted times of both schedules on 2x2 and 3x2 hosts."""
    rows = []
    sizes = [16 << 20, 64 << 20]
    for hosts in (2, 3):
        with namespace_hosts().NetnsHosts(hosts, shape) as net:
            for hier in (True, False):
                measured = _time(net, 2, hier, sizes)
                for nbytes, seconds in measured.items():
                    predicted = (model.hierarchical(nbytes, hosts, 2, local_bw) if hier
                                 else model.flat(nbytes, hosts, 2))
                    rows.append({"hosts": hosts, "schedule": "hier" if hier else "flat",
                                 "bytes": nbytes, "measured": seconds, "predicted": predicted})
    return rows


def projection(model: LinkModel, per_host: int, local_bw: float, step_s: dict[str, float]
               ) -> list[str]:
    """Table lines: efficiency per host count, model and schedule."""
    head = f"{'hosts':>6} {'GPUs':>6} |" + "".join(
        f" {name + ' ' + sched:>22} |" for name in step_s for sched in ("flat", "hier"))
    lines = [head]
    sizes = {"resnet50": RESNET50_BYTES, "vgg16": VGG16_BYTES}
    for hosts in HOST_COUNTS:
        cells = []
        for name, compute in step_s.items():
            for sched in ("flat", "hier"):
                comm = (model.flat(sizes[name], hosts, per_host) if sched == "flat"
                        else model.hierarchical(sizes[name], hosts, per_host, local_bw))
                no, full = efficiency(compute, comm)
                cells.append(f" {no * 100:9.0f}% .. {full * 100:6.0f}%   |")
        lines.append(f"{hosts:>6} {hosts * per_host:>6} |" + "".join(cells))
    return lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options of the scaling benchmark."""
    p = argparse.ArgumentParser(prog="python -m hvd_spark.bench scaling")
    p.add_argument("--bandwidth", default="1gbit", help="link rate of the measured hosts")
    p.add_argument("--project-bandwidth", default="25gbit",
                   help="link rate of the projected cluster (Horovod's: 25 Gbit/s RoCE)")
    p.add_argument("--project-alpha-us", type=float, default=None,
                   help="seconds per ring step on the projected cluster (default: measured)")
    p.add_argument("--ranks-per-host", type=int, default=4, help="GPUs per projected host")
    p.add_argument("--local-gbps", type=float, default=10.0,
                   help="GB/s of the projected hosts' local phases (NVLink/PCIe, shared memory)")
    p.add_argument("--resnet-step-ms", type=float, default=200.0,
                   help="compute per step of ResNet-50 (assumed: about batch 64 on a V100)")
    p.add_argument("--vgg-step-ms", type=float, default=300.0,
                   help="compute per step of VGG-16 (assumed: about batch 64 on a V100)")
    p.add_argument("--skip-validation", action="store_true", help="project only")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    """Calibrate on namespace hosts, validate on 2-3 hosts, project to 8-512 hosts."""
    args = parse_args(argv)
    harness = namespace_hosts()
    rate_bits = harness.rate_bits
    shape = harness.LinkShape(args.bandwidth)
    model = calibrate(shape)
    print(f"measured on 2 namespace hosts, links {shape.describe()}: alpha "
          f"{model.alpha * 1e6:.0f} us per ring step, link {model.bandwidth / 1e6:.1f} MB/s "
          f"(nominal {rate_bits(args.bandwidth) / 8e6:.1f})")
    if not args.skip_validation:
        local_bw = 1.0e9  # this machine's shared-memory phases, loaded: about 1 GB/s
        print("model vs harness (2 ranks per host):")
        worst = 0.0
        for row in validate(model, shape, local_bw):
            error = row["predicted"] / row["measured"] - 1
            worst = max(worst, abs(error))
            print(f"  {row['hosts']} hosts {row['schedule']:4s} {row['bytes'] >> 20:3d} MB: "
                  f"measured {row['measured'] * 1e3:7.1f} ms, predicted "
                  f"{row['predicted'] * 1e3:7.1f} ms ({error * 100:+.0f}%)")
        print(f"  largest error {worst * 100:.0f}% (target: within 15%)")
    alpha = (args.project_alpha_us * 1e-6 if args.project_alpha_us is not None
             else model.alpha)
    projected = LinkModel(alpha, rate_bits(args.project_bandwidth) / 8)
    print(f"\nprojection: {args.ranks_per_host} GPUs per host, links "
          f"{args.project_bandwidth}, alpha {alpha * 1e6:.0f} us; compute per step ResNet-50 "
          f"{args.resnet_step_ms:.0f} ms ({RESNET50_BYTES / 1e6:.0f} MB of gradients), VGG-16 "
          f"{args.vgg_step_ms:.0f} ms ({VGG16_BYTES / 1e6:.0f} MB); efficiency no overlap .. "
          "full overlap")
    steps = {"resnet50": args.resnet_step_ms / 1e3, "vgg16": args.vgg_step_ms / 1e3}
    for line in projection(projected, args.ranks_per_host, args.local_gbps * 1e9, steps):
        print(line)
    print(_PUBLISHED)
    return 0
