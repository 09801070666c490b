"""The MPI backend: ranks started by ``mpirun`` (``hvdrun --mpi``), bytes moved by MPI.

Imported only when that backend is chosen: importing ``hvd_spark.collectives`` never
imports ``mpi4py``. ``world.start`` forms the job from ``MPI.COMM_WORLD``;
``engine.MpiEngine`` negotiates over MPI as Horovod's MPI controller does;
``communicator.MpiCommunicator`` runs the buffer collectives.
"""
