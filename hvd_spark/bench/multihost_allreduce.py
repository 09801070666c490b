"""``python -m hvd_spark.bench allreduce --hosts H --ranks-per-host R [--bandwidth 1gbit]``.

Builds H namespace hosts (``netns_cluster.hosts``) with shaped links, starts R ranks on each
(the launcher's rendezvous store on the bridge, every rank in its host's namespaces),
and times all-reduce of each size four ways on the same hosts and links: hvd_spark
hierarchical, hvd_spark flat ring, torch Gloo (in the flat run's processes, in
alternation), and Open MPI (mpirun across the hosts, TCP between them, shared memory
within one). Needs root (see ``netns_cluster.hosts.problem``) and a source checkout:
the namespace harness is test support, not part of the wheel.

busbw = 2(N-1)/N x bytes / time (comparable across N). For H hosts the network-bound
limit of algbw (bytes / time) is the link rate x H / (2(H-1)): the link rate for 2 hosts.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import sys
import tempfile
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from hvd_spark import _env
from hvd_spark.bench.timing import busbw, human_size, iterations, parse_size, time_loop
from hvd_spark.errors import ConfigError, WorkerFailedError

if TYPE_CHECKING:
    from netns_cluster.hosts import LinkShape, NetnsHosts

_RESULT = "BENCHRESULT "
#: Sizes of the ``--hosts`` form when ``--sizes`` is left at the host default.
HOSTS_SIZES = "1M,64M"


def namespace_hosts() -> ModuleType:
    """``netns_cluster.hosts``, the namespace-host harness of a source checkout.

    Raises:
        ConfigError: It is not importable (an installed wheel does not ship it).
    """
    try:
        from netns_cluster import hosts
    except ImportError:
        raise ConfigError(
            "the several-host benchmarks (allreduce --hosts, scaling) build their hosts with "
            "the namespace harness netns_cluster, which is test support in a source checkout "
            "of hvd_spark and not part of the installed package: run them from the "
            "repository's root (git clone, then python -m hvd_spark.bench ...)") from None
    return hosts


def _gloo(hvd, address: str) -> Any:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    port = None
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind((address, 0))
            port = s.getsockname()[1]
    where = hvd.broadcast_object((address, port), 0)
    dist.init_process_group("gloo", init_method=f"tcp://{where[0]}:{where[1]}",
                            rank=hvd.rank(), world_size=hvd.size())
    return torch, dist


def rank_main(opts: dict) -> None:
    """One rank: time our all-reduce (and Gloo's when asked); rank 0 prints the rows."""
    import hvd_spark.collectives as hvd
    from hvd_spark.collectives import _plumbing

    hvd.init()
    address = socket.gethostbyname(socket.gethostname())
    gloo = _gloo(hvd, address) if opts["gloo"] else None

    def reduce_max(seconds: float) -> float:
        return float(hvd.allreduce(np.array([seconds]), name="bench.t", op=hvd.Max)[0])

    rows = []
    for nbytes in opts["sizes"]:
        arr = np.zeros(nbytes // 4, np.float32)
        iters = iterations(nbytes, opts["budget"])
        row = {"bytes": arr.nbytes, "iters": iters}
        for _ in range(opts["rounds"]):  # alternate, so drift in the machine hits both
            row.setdefault("hvd", []).append(time_loop(
                lambda a=arr: hvd.allreduce_(a, name="bench.a", op=hvd.Sum), iters,
                hvd.barrier, reduce_max))
            if gloo is not None:
                torch, dist = gloo
                tensor = torch.zeros(arr.size, dtype=torch.float32)
                row.setdefault("gloo", []).append(time_loop(
                    lambda t=tensor, d=dist: d.all_reduce(t), iters, dist.barrier, reduce_max))
        rows.append({k: min(v) if isinstance(v, list) else v for k, v in row.items()})
    kind = type(_plumbing.current_engine().comm).__name__
    if gloo is not None:
        gloo[1].destroy_process_group()
    if hvd.rank() == 0:
        print(_RESULT + json.dumps({"size": hvd.size(), "comm": kind, "rows": rows}), flush=True)


def launch(net: NetnsHosts, ranks_per_host: int, env: dict[str, str], opts: dict) -> dict:
    """Run ``rank_main`` on every host's ranks (``env`` added to theirs); rank 0's result."""
    from hvd_spark.runner.local.hosts import HostSlots, place_ranks
    from hvd_spark.runner.local.ssh_launcher import SshJob

    class NamespaceJob(SshJob):
        def command_for(self, info, command):
            host = net.addrs.index(info.host)
            return net.joined_argv(host, [sys.executable, "-m",
                                          "hvd_spark.runner.local.remote_rank", *command])

    placement = place_ranks([HostSlots(a, ranks_per_host) for a in net.addrs],
                            net.count * ranks_per_host)
    out = io.StringIO()
    with NamespaceJob(placement, env, stdout=out, stderr=sys.stderr) as job:
        job.start([sys.executable, "-m", "hvd_spark.bench.multihost_allreduce",
                   "--rank-worker", json.dumps(opts)])
        failures = job.wait(expect_reports=False)
    if failures:
        raise WorkerFailedError(failures)
    for line in out.getvalue().splitlines():
        if _RESULT in line:
            return json.loads(line.split(_RESULT, 1)[1])
    raise ConfigError(f"rank 0 printed no result; its output:\n{out.getvalue()[-2000:]}")


def _ssh_agent(net: NetnsHosts, folder: str) -> str:
    """Write the script mpirun starts its remote daemons with (in place of ssh): it runs
    the command on the named host, inside that host's namespaces. Returns its path."""
    lines = ["#!/bin/sh", "host=$1; shift", 'case "$host" in']
    for i, (addr, name) in enumerate(zip(net.addrs, net.hostnames)):
        enter = " ".join(net.joined_argv(i, []))
        lines.append(f'  {addr}|{name}) exec {enter} sh -c "$*" ;;')
    lines += ['  *) echo "no namespace host $host" >&2; exit 1 ;;', "esac", ""]
    path = os.path.join(folder, "netns-agent.sh")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    os.chmod(path, 0o755)
    return path


def mpi_across(net: NetnsHosts, ranks_per_host: int, sizes: list[int],
               budget: float) -> tuple[list[dict], str]:
    """Open MPI's Allreduce on the same hosts: mpirun on the first host, its daemons on the
    others through ``_ssh_agent``; TCP (the tcp BTL) between hosts, shared memory within.
    Returns the rows and mpirun's version (or why there are none)."""
    from hvd_spark.bench.mpi_peer import run_mpi

    subnet = net.addrs[0].rsplit(".", 1)[0] + ".0/24"
    with tempfile.TemporaryDirectory() as folder:
        args = ["-H", ",".join(f"{addr}:{ranks_per_host}" for addr in net.addrs),
                "--prtemca", "plm_ssh_agent", _ssh_agent(net, folder),
                "--mca", "btl", "tcp,self,sm", "--mca", "btl_tcp_if_include", subnet,
                # The hosts share this machine's cores: a rank that spins while it waits
                # (Open MPI's default) starves the others and the kernel's network path
                # (10x slower here); ours and Gloo's sleep in the kernel.
                "--mca", "mpi_yield_when_idle", "1"]
        argv = ["--sizes", ",".join(str(s) for s in sizes), "--budget-mb", str(budget / 1e6)]
        return run_mpi(net.count * ranks_per_host, argv, args,
                       wrap=lambda command: net.joined_argv(0, command))


def measure(hosts: int, ranks_per_host: int, shape: LinkShape, sizes: list[int],
            budget: float, rounds: int = 2) -> dict:
    """Hierarchical and flat runs (Gloo with the flat one), then Open MPI, on one set of
    hosts."""
    opts = {"sizes": sizes, "budget": budget, "rounds": rounds}
    harness = namespace_hosts()
    # The namespace hosts share this machine's cores, which a rank's count of the ranks
    # on its own host does not see: a waiting rank that polls (our default where a host
    # has a core per rank, as real hosts do) takes the core from another host's rank, and
    # cost 1.3-1.9x here. So ours block, as Gloo's do and as Open MPI's yield (below).
    blocking = {_env.SPIN_US: "0"}
    with harness.NetnsHosts(hosts, shape) as net:
        hier = launch(net, ranks_per_host, {_env.HIERARCHICAL_ALLREDUCE: "1", **blocking},
                      {**opts, "gloo": False})
        flat = launch(net, ranks_per_host, {_env.HIERARCHICAL_ALLREDUCE: "0", **blocking},
                      {**opts, "gloo": True})
        mpi_rows, mpi = mpi_across(net, ranks_per_host, sizes, budget)
    return {"hosts": hosts, "ranks_per_host": ranks_per_host, "shape": shape.describe(),
            "link_bits": harness.rate_bits(shape.bandwidth) if shape.bandwidth else None,
            "hier": hier, "flat": flat, "mpi": mpi, "mpi_rows": mpi_rows}


def format_table(result: dict) -> str:
    """Rows per size: time and busbw of each, ratios, algbw against the link."""
    n = result["hier"]["size"]
    hosts = result["hosts"]
    link = result["link_bits"]
    limit = link / 8 * hosts / (2 * (hosts - 1)) / 1e9 if link and hosts > 1 else None
    lines = [f"allreduce on {hosts} hosts x {result['ranks_per_host']} ranks ({n} ranks), links "
             f"{result['shape']}; float32 Sum in place; GB/s (busbw = 2(N-1)/N x bytes / time)"
             + (f"; network limit of algbw {limit:.3f} GB/s" if limit else ""),
             f"hierarchical: {result['hier']['comm']}; flat: {result['flat']['comm']}; "
             f"{result.get('mpi', 'MPI: not run')}",
             f"{'size':>6} | {'hier ms':>8} {'busbw':>6} {'algbw':>6} | {'flat ms':>8} "
             f"{'busbw':>6} | {'gloo ms':>8} {'busbw':>6} | {'mpi ms':>8} {'busbw':>6} | "
             f"{'x gloo':>6} {'x mpi':>6} {'x flat':>6}"
             + (f" {'% link':>6}" if limit else "")]
    flat_rows = {r["bytes"]: r for r in result["flat"]["rows"]}
    mpi_rows = {r["bytes"]: r["mpi"] for r in result.get("mpi_rows", [])}
    for row in result["hier"]["rows"]:
        b = row["bytes"]
        h, f = row["hvd"], flat_rows[b]["hvd"]
        g = flat_rows[b].get("gloo", float("nan"))
        mp = mpi_rows.get(b, float("nan"))
        line = (f"{human_size(b):>6} | {h * 1e3:8.1f} {busbw(b, h, n):6.3f} {b / h / 1e9:6.3f} | "
                f"{f * 1e3:8.1f} {busbw(b, f, n):6.3f} | {g * 1e3:8.1f} {busbw(b, g, n):6.3f} | "
                f"{mp * 1e3:8.1f} {busbw(b, mp, n):6.3f} | {g / h:6.2f} {mp / h:6.2f} {f / h:6.2f}")
        if limit:
            line += f" {b / h / 1e9 / limit * 100:5.0f}%"
        lines.append(line)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """The ``--hosts`` form of ``python -m hvd_spark.bench allreduce``."""
    if args.hosts < 2 or args.ranks_per_host < 1:
        raise ConfigError("--hosts must be at least 2 and --ranks-per-host at least 1")
    shape = namespace_hosts().LinkShape(args.bandwidth, args.delay)
    sizes = [parse_size(s) for s in (args.sizes or HOSTS_SIZES).split(",")]
    result = measure(args.hosts, args.ranks_per_host, shape, sizes, args.budget_mb * 1e6)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-worker":
        rank_main(json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit("python -m hvd_spark.bench allreduce --hosts H ... starts this module's ranks")
