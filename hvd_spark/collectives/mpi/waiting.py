"""Waiting for MPI requests with a deadline, and the abort notices that end a wait early.

MPI has no timeouts and a blocking MPI call cannot be interrupted, so every wait here
polls a non-blocking request: it spins for a millisecond (small messages complete
within microseconds, and giving the CPU away on a loaded machine can lose it for a time
slice: 2 ranks on 2 busy cores, 1 KB allreduce 1.8-3 ms against 9-10 ms with a 100 us
spin), then yields the CPU between polls, then sleeps in growing steps. An idle engine
costs about 4% of a core either way: its waits are mostly between cycles, not in them. Each
wait also watches the abort channel: a rank that fails or closes its backend tells
every peer, and their waits end at once instead of at the timeout.
"""

from __future__ import annotations

import os
import time
from typing import Any

from mpi4py import MPI

from hvd_spark.errors import CollectiveTimeoutError, PeerDisconnectedError

ABORT_TAG = 77
_SPIN_S = 1e-3
_YIELD_S = 3e-3
_MAX_SLEEP_S = 1e-3
_PROBE_EVERY = 64


class AbortChannel:
    """Point-to-point notices on a dedicated communicator: "rank r gave up, because ...".

    Args:
        comm: A communicator of all ranks, used for nothing else.
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.notice: str | None = None
        self._sent = False

    def check(self) -> str | None:
        """The first notice received from a peer, or None (cheap: one Iprobe)."""
        if self.notice is None and self.size > 1:
            status = MPI.Status()
            if self.comm.Iprobe(MPI.ANY_SOURCE, ABORT_TAG, status):
                reason = self.comm.recv(source=status.Get_source(), tag=ABORT_TAG)
                self.notice = f"rank {status.Get_source()} stopped: {reason}"
        return self.notice

    def interrupt(self, reason: str) -> None:
        """End this rank's own waits now (from any thread), as a peer's notice would."""
        if self.notice is None:
            self.notice = reason

    def send(self, reason: str) -> None:
        """Tell every peer we gave up (once; never blocks: small sends are buffered)."""
        if self._sent or self.size == 1:
            return
        self._sent = True
        for peer in range(self.size):
            if peer != self.rank:
                try:
                    self.comm.isend(reason, dest=peer, tag=ABORT_TAG)
                except MPI.Exception:
                    pass  # the peer's process may be gone already


def wait(request: Any, deadline: float, abort: AbortChannel | None, what: str) -> None:
    """Wait for ``request`` until ``deadline`` (``time.monotonic()``), watching ``abort``.

    Raises:
        CollectiveTimeoutError: Not complete by the deadline.
        PeerDisconnectedError: A peer sent an abort notice meanwhile.
    """
    if request.Test():
        return
    start = time.monotonic()
    polls = 0
    sleep = 0.0
    yielding = False
    while True:
        polls += 1
        if yielding or polls % _PROBE_EVERY == 0:
            now = time.monotonic()
            if abort is not None and abort.check() is not None:
                raise PeerDisconnectedError(f"{what} cannot complete: {abort.notice}")
            if now > deadline:
                raise CollectiveTimeoutError(
                    f"{what} did not complete within the deadline (HVD_SPARK_TIMEOUT); a rank "
                    "may be stuck or may not have called it")
            if now - start > _YIELD_S:
                yielding = True
                sleep = min(max(sleep * 2, 20e-6), _MAX_SLEEP_S)
                time.sleep(sleep)
            elif now - start > _SPIN_S:
                # Give the CPU to whoever we wait for (often a peer on the same core), but
                # come back at once when nobody else needs it: a sleep costs a timer tick.
                yielding = True
                os.sched_yield()
        if request.Test():
            return
