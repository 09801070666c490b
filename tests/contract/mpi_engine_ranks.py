"""One MPI rank running the engine contract's jobs on MpiEngines (run under mpirun).

Every job named in ``HVD_TEST_ENGINE_JOBS`` runs in turn on a fresh engine of this rank
(``mpi.world.start``, as ``init()`` forms one), and its outcome is pickled to
``<HVD_TEST_ENGINE_OUT>/<job>.<rank>.pkl`` for the test process to check.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading

from hvd_spark.collectives.mpi.world import start
from tests.contract import engine_jobs

JOBS_VAR = "HVD_TEST_ENGINE_JOBS"
OUT_VAR = "HVD_TEST_ENGINE_OUT"


def run(name: str) -> tuple[int, tuple]:
    """Run job ``name`` on a new engine; return (rank, outcome)."""
    before = frozenset(threading.enumerate())
    world, engine, _ = start(engine_jobs.config_for(name))
    try:
        rank = engine_jobs.Rank(engine, world.rank, world.size, threads_before=before)
        outcome: tuple = ("ok", engine_jobs.JOBS[name](rank))
    except BaseException as exc:  # noqa: BLE001 - the test reports it
        outcome = ("err", type(exc).__name__, str(exc))
    finally:
        engine.shutdown()
    return world.rank, outcome


def main() -> int:
    out = os.environ[OUT_VAR]
    for name in os.environ[JOBS_VAR].split(","):
        rank, outcome = run(name)
        with open(os.path.join(out, f"{name}.{rank}.pkl"), "wb") as f:
            pickle.dump(outcome, f)
    sys.stdout.flush()
    # After a rank's failure, requests of the failed engine may never complete and
    # MPI_Finalize could wait for them: leave without it.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
