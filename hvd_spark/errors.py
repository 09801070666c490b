"""The exception family of hvd_spark.

Every error says what happened, which rank/tensor/column is involved, and what to
do about it. All of them pickle, so they cross process boundaries intact.
"""

from __future__ import annotations


class HvdSparkError(Exception):
    """Base class of every error raised by hvd_spark."""


class ConfigError(HvdSparkError, ValueError):
    """A parameter or environment variable has a value that cannot work."""


class BackendUnavailableError(HvdSparkError):
    """The requested communication backend cannot be used here (missing package, no GPU)."""


class RendezvousTimeoutError(HvdSparkError, TimeoutError):
    """Not all ranks arrived at the rendezvous before the deadline."""


class AuthenticationError(HvdSparkError):
    """A peer failed to prove that it knows this job's secret."""


class CollectiveError(HvdSparkError, RuntimeError):
    """A collective operation failed (mismatched arguments, broken ring, engine stopped).

    A ``RuntimeError``, as Horovod's collective errors are, so ported ``except`` clauses work.
    """


class CollectiveArgumentError(CollectiveError, ValueError):
    """Ranks passed arguments that cannot work together (dtype, shape, op, root, splits).

    Also a ``ValueError``: Horovod raises either for these, depending on where it checks.
    """


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective operation did not complete before its deadline."""


class HorovodInternalError(CollectiveError):
    """The collectives stopped working on this rank (a peer died, the ring broke).

    Horovod's name: elastic training catches it, restores the last commit and re-forms the ring.
    """


class PeerDisconnectedError(HorovodInternalError):
    """A peer rank closed its connection or died while a collective was running."""


class HostsUpdatedInterrupt(HvdSparkError, RuntimeError):
    """Hosts were added or removed: elastic training re-forms the ring at the next commit.

    Args:
        skip_sync: True when the state need not be synced again (only ranks were added).
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of hosts changed; the job re-forms its ring")
        self.skip_sync = skip_sync

    def __reduce__(self):
        return (HostsUpdatedInterrupt, (self.skip_sync,))


class ElasticJobError(HvdSparkError):
    """An elastic job cannot continue: too few workers left, ``reset_limit`` reached, or no
    generation of the ring formed in time; the message names what was lost and why."""


class DataError(HvdSparkError):
    """Input data cannot be used for training (bad column, nulls, too few rows)."""


class WorkerFailedError(HvdSparkError):
    """One or more ranks failed; the first real failure is shown as the root cause.

    Failures that are only consequences of another rank's (a peer disconnected, a
    rank torn down by the launcher) sort after the others, then by time.

    Args:
        failures: One ``WorkerFailure`` per failed rank, any order.
    """

    def __init__(self, failures: list) -> None:
        self.failures = sorted(failures, key=lambda f: (f.secondary, f.timestamp))
        super().__init__(self._format())

    def __reduce__(self):
        return (WorkerFailedError, (self.failures,))

    @property
    def root_cause(self):
        """The failure that happened first."""
        return self.failures[0]

    def _format(self) -> str:
        if not self.failures:
            return "a worker failed without reporting why"
        root = self.failures[0]
        ranks = ", ".join(str(f.rank) for f in self.failures)
        lines = [
            f"{len(self.failures)} rank(s) failed ({ranks}); root cause: rank {root.rank} "
            f"on host {root.host}: {root.message}",
        ]
        if root.traceback:
            lines += ["", f"Traceback of rank {root.rank} (root cause):", root.traceback.rstrip()]
        others = self.failures[1:]
        if others:
            lines += ["", "Other failures (likely consequences of the root cause):"]
            lines += [f"  rank {f.rank} on {f.host}: {f.message}" for f in others]
        return "\n".join(lines)
