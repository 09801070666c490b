"""Launchers without Spark: local processes, hosts over ssh (``hvdrun -H``), ``mpirun``.

Empty on purpose: ``hvdrun`` imports only the launcher it uses.
"""
