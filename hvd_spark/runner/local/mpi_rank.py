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
    sys.stdout.flush()
    os.execvp(argv[0], argv)
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
