"""What both elastic launchers share: the final ring's results, and which failures end a run.

``ElasticLocalJob`` (local processes) and ``ElasticSparkJob`` (Spark tasks) start their
workers differently, but a worker's failure means the same under both: a lost peer is
the ring breaking under it (the survivors re-form), anything else is ``fn`` failing (the
run ends with it); and the run's results are the final generation's, in rank order.
"""

from __future__ import annotations

from hvd_spark.errors import ElasticJobError, WorkerFailedError
from hvd_spark.runner.elastic.elastic_driver import ElasticDriver
from hvd_spark.runner.failures import WorkerFailure
from hvd_spark.runner.launcher import Launcher

#: Seconds the members of a finished ring may take to report their results.
FINISH_GRACE_S = 60.0
#: What a worker's failure says when the ring broke under it, rather than ``fn`` failing.
_LOST_PEER_ERRORS = ("HorovodInternalError", "PeerDisconnectedError", "ElasticJobError",
                     "RendezvousTimeoutError", "HostsUpdatedInterrupt")


def is_lost_peer_failure(failure: WorkerFailure) -> bool:
    """True when a worker failed because the ring broke under it, not because of ``fn``."""
    return any(name in failure.message for name in _LOST_PEER_ERRORS)


def results_in_rank_order(results: dict[str, tuple[int, bytes]], members: dict) -> list[bytes]:
    """The final generation's pickled results by rank (workers outside it are left out).

    Raises:
        ElasticJobError: A member of the final generation has no result.
    """
    final = {w: results[w] for w in members if w in results}
    missing = sorted(set(members) - set(final))
    if missing:
        raise ElasticJobError(f"workers {missing} of the final ring ended without a result")
    return [payload for _, payload in sorted(final.values())]


class ElasticJob(Launcher):
    """A ``Launcher`` of elastic workers: ``watch`` fills ``results`` (worker id -> final
    rank and pickled result) and ``failed`` (failures of ``fn``, which end the run)."""

    driver: ElasticDriver

    def __init__(self) -> None:
        self.results: dict[str, tuple[int, bytes]] = {}
        self.failed: list[WorkerFailure] = []

    def collect(self) -> list[bytes]:
        """The final ring's pickled results in rank order, after ``watch``.

        Raises:
            WorkerFailedError: A rank failed.
            ElasticJobError: A member of the final ring ended without a result.
        """
        if self.failed:
            raise WorkerFailedError(self.failed)
        return results_in_rank_order(self.results, self.driver.members)
