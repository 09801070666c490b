"""The MPI backend: ranks started by ``mpirun`` (``hvdrun --mpi``), bytes moved by MPI.

Imported only when that backend is chosen: importing ``hvd_spark.collectives`` never
imports ``mpi4py``. ``world.start`` forms the job from ``MPI.COMM_WORLD``;
``engine.MpiEngine`` negotiates over MPI as Horovod's MPI controller does;
``communicator.MpiCommunicator`` runs the buffer collectives.
"""

from hvd_spark.errors import BackendUnavailableError


def create(world, config, data_socks):
    """Registry factory: the MPI backend forms its own job, it cannot join a TCP mesh."""
    del world, config, data_socks
    raise BackendUnavailableError(
        "the MPI backend runs only in ranks started by mpirun (hvdrun --mpi -np N ...); "
        "inside Spark or under plain hvdrun, use the tcp backend")
