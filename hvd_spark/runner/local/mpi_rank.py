"""What ``mpirun`` starts for each rank of an ``MpiJob``: name the rank, then run the command.

``python -m hvd_spark.runner.local.mpi_rank command...`` sets ``HVD_SPARK_RANK`` from
the MPI launcher's own variable (so the rank reports under its MPI rank) and replaces
itself with ``command``: its signals and exit code are the command's.
"""

from __future__ import annotations

import os
import sys

from hvd_spark import _env

#: Where Open MPI and MPICH (Hydra) put the rank of the process they start.
MPI_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK")
#: torch's name -> where Open MPI, then MPICH, put the same number.
_TORCH_FROM_MPI = {
    _env.TORCH_WORLD_SIZE: ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
    _env.TORCH_LOCAL_RANK: ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
    _env.TORCH_LOCAL_WORLD_SIZE: ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"),
}


def mpi_rank(environ: dict[str, str] | None = None) -> str | None:
    """This process's MPI rank as the launcher set it, or None outside mpirun."""
    environ = dict(os.environ if environ is None else environ)
    return next((environ[v] for v in MPI_RANK_VARIABLES if v in environ), None)


def main(argv: list[str]) -> int:
    """Set the rank variable and exec ``argv``; return 2 when there is nothing to run."""
    rank = mpi_rank()
    if not argv or rank is None:
        sys.stderr.write("usage: mpirun ... python -m hvd_spark.runner.local.mpi_rank "
                         f"command... (needs one of {', '.join(MPI_RANK_VARIABLES)})\n")
        return 2
    os.environ[_env.RANK] = rank
    # torchrun's names too, so torch.distributed code runs under hvdrun --mpi.
    os.environ[_env.TORCH_RANK] = rank
    for name, sources in _TORCH_FROM_MPI.items():
        value = next((os.environ[v] for v in sources if v in os.environ), None)
        if value is not None:
            os.environ[name] = value
    size = int(os.environ.get(_env.TORCH_WORLD_SIZE, "1"))
    for name, value in _env.torchrun_variables(rank=int(rank), size=size, node_rank=0,
                                             num_nodes=1, run_id="mpi").items():
        os.environ.setdefault(name, value)
    sys.stdout.flush()
    os.execvp(argv[0], argv)
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
