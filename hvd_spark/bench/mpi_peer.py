"""The allreduce benchmarks' Open MPI peer: ``MPI_Allreduce`` (mpi4py) under mpirun.

``run_mpi`` starts ``python -m hvd_spark.bench.mpi_peer --sizes ... --budget-mb ...``
under mpirun (on this host, or across namespace hosts with the options and wrapper
``bench.multihost_allreduce`` gives) and reads the rows rank 0 prints. Its own module, so
the one-host and several-host benchmarks share it without importing each other.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence

import numpy as np

from hvd_spark.bench.timing import iterations, parse_size, time_loop


def mpi_worker(sizes: list[int], budget: float) -> None:
    """Run under mpirun: time MPI Allreduce (in place) and print JSON from rank 0."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rows = []
    for nbytes in sizes:
        arr = np.zeros(nbytes // 4, np.float32)
        iters = iterations(nbytes, budget)
        seconds = time_loop(
            lambda arr=arr: comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM), iters, comm.Barrier,
            lambda s: comm.allreduce(s, op=MPI.MAX))
        rows.append({"bytes": arr.nbytes, "mpi": seconds})
    if comm.rank == 0:
        print("MPIRESULT " + json.dumps(rows), flush=True)


def run_mpi(num_proc: int, argv: list[str], mpirun_args: Sequence[str] = ("--oversubscribe",),
            wrap: Callable[[list[str]], list[str]] = list) -> tuple[list[dict], str]:
    """Run the MPI peer under mpirun; returns rows and a description (or why it is absent).

    Args:
        num_proc: Ranks.
        argv: ``mpi_worker``'s options: ``--sizes`` and ``--budget-mb``.
        mpirun_args: mpirun's options before the program (hosts, MCA settings).
        wrap: Turns mpirun's command line into the one to run (e.g. inside a namespace).
    """
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return [], "MPI: mpi4py not installed"
    if mpirun is None:
        return [], "MPI: no mpirun found"
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           # Its daemons on other hosts find prted and python on this PATH.
           "PATH": os.path.dirname(mpirun) + os.pathsep + os.environ.get("PATH", "")}
    env = {k: v for k, v in env.items() if not k.startswith("HVD_SPARK_")}
    cmd = wrap([mpirun, "-np", str(num_proc), *mpirun_args, sys.executable, "-m",
                "hvd_spark.bench.mpi_peer", *argv])
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    except subprocess.TimeoutExpired:
        return [], "MPI: mpirun timed out"
    for line in proc.stdout.splitlines():
        if line.startswith("MPIRESULT "):
            version = subprocess.run([mpirun, "--version"], capture_output=True, text=True)
            return json.loads(line[len("MPIRESULT "):]), version.stdout.splitlines()[0]
    return [], f"MPI: mpirun failed: {proc.stderr.strip()[-300:]}"


def main(argv: list[str]) -> int:
    """Run as one of mpirun's ranks."""
    p = argparse.ArgumentParser(prog="python -m hvd_spark.bench.mpi_peer")
    p.add_argument("--sizes", required=True, help="comma list, e.g. 4K,1M")
    p.add_argument("--budget-mb", type=float, required=True, help="bytes reduced per size, MB")
    args = p.parse_args(argv)
    mpi_worker([parse_size(s) for s in args.sizes.split(",")], args.budget_mb * 1e6)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
