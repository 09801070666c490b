"""Elastic membership, launcher side: which live workers form each generation of the ring.

Workers have stable ids (a slot, a Spark partition). Each ``init()`` of an elastic worker
asks to *join* the next generation; the driver forms a generation once every live
worker is waiting (or the stragglers are declared lost), assigns ranks host by host with
the previous generation's ranks first (so rank 0, whose state the others sync from,
survives whenever it can), and answers every join at once. Workers beat a heartbeat;
one that falls silent, exits or is reported lost breaks its generation, and the driver
tells the survivors through their next heartbeat, so that their collectives fail within
seconds. All waits have deadlines; a job that cannot continue (fewer than ``min_np``
workers, ``reset_limit`` reached) ends with an error naming what was lost and why.

This module knows no launcher: the local launcher and ``run_elastic`` on Spark feed it
events and serve its handlers from their authenticated stores.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from hvd_spark.errors import ElasticJobError
from hvd_spark.runner.heartbeat_monitor import BEAT, HeartbeatMonitor
from hvd_spark.runner.rendezvous import RankInfo, TaskSlot, assign_ranks, with_master
from hvd_spark.runner.run_config import ElasticConfig

log = logging.getLogger(__name__)

JOIN = "elastic.join"
STARTED = "elastic.started"
VERSION = "elastic.version"
DESCRIBE = "elastic.describe"
_CHECK_PERIOD_S = 0.25


@dataclasses.dataclass(frozen=True)
class Assignment:
    """What a joining worker learns: its place in a generation.

    Attributes:
        generation: Number of the generation (1, 2, ...); also the mesh epoch.
        info: Rank, size, local and cross ranks in that generation.
        version: The hosts version when the generation formed; a higher version
            later means workers are waiting to join (``check_host_updates``).
    """

    generation: int
    info: RankInfo
    version: int


#: The flat spelling of an ``ElasticConfig`` (``ElasticSettings(num_proc=..., min_np=...,
#: start_timeout=...)``), kept for the callers that build one by hand.
ElasticSettings = ElasticConfig.of


class ElasticDriver:
    """Forms generations of live workers; serves ``join``, ``version`` and ``beat``.

    Args:
        settings: Sizes and deadlines.
        on_lost: Called (outside the lock) with ``(worker, reason)`` when a worker is
            declared lost, so the launcher can stop what is left of it.
        on_event: Called with one line for each membership change worth telling the user.
    """

    def __init__(
        self,
        settings: ElasticConfig,
        on_lost: Callable[[str, str], None] | None = None,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self._on_lost = on_lost or (lambda worker, reason: None)
        self._on_event = on_event or log.info
        self._cond = threading.Condition()
        self.generation = 0
        self.members: dict[str, RankInfo] = {}
        self._endpoints: dict[str, tuple[str, int] | None] = {}
        self._alive: dict[str, str] = {}  # worker -> host
        self._arrival: dict[str, int] = {}
        self._waiting: set[str] = set()
        self.lost: dict[str, str] = {}  # worker -> why, in the order they were lost
        self._broken: str | None = None
        self._broken_by_loss = False
        self._broken_at = 0.0
        self.version = 0
        self._formed_version = 0
        self.fatal: str | None = None
        self.resets = 0
        self.finished = False
        self._closed = False
        self._labels: dict[str, str] = {}
        self._started = time.monotonic()
        # Its thread also drives the deadlines (start and elastic timeouts) between joins.
        self._heartbeats = HeartbeatMonitor(settings.heartbeat_s, on_checked=self._on_checked)

    # ------------------------------------------------------------------ handlers

    def handlers(self) -> dict[str, Callable]:
        """The store request kinds this driver serves."""
        return {JOIN: self.join, VERSION: self.current_version, BEAT: self.beat,
                DESCRIBE: self.describe, STARTED: self.worker_started}

    def describe(self, worker: str, label: str) -> None:
        """Name what hosts ``worker`` (e.g. "Spark executor 2"), for the messages."""
        with self._cond:
            self._labels[worker] = f", {label}"

    def join(self, worker: str, host: str, last_generation: int,
             endpoint: tuple[str, int] | None = None) -> dict:
        """Block until ``worker`` has a place in a generation newer than ``last_generation``.

        ``endpoint``: the worker's address and a port free on its host now; rank 0's becomes
        the generation's torch.distributed master (``master_addr``/``master_port``).

        Returns:
            The worker's :class:`Assignment` as a plain dict (workers do not import the
            runner): ``generation``, ``version`` and the RankInfo fields.

        Raises:
            ElasticJobError: The job cannot go on, or this worker was declared lost.
        """
        lost_events: list[tuple[str, str]] = []
        with self._cond:
            if worker in self.lost:
                raise ElasticJobError(
                    f"worker {worker} was declared lost ({self.lost[worker]}) and may not rejoin")
            if self.finished:
                raise ElasticJobError("the elastic job has finished; no generation will form")
            self._register(worker, host)
            self._endpoints[worker] = endpoint
            if worker in self.members and last_generation == self.generation:
                rank = self.members[worker].rank
                self._break(f"rank {rank} on {host} left generation {self.generation} to "
                            "re-form", by_loss=False)
            self._waiting.add(worker)
            if (worker not in self.members and self.generation > 0 and self._broken is None
                    and len(self.members) < self.settings.max_np):
                self.version += 1  # new capacity: members notice at their next commit
                self._on_event(f"worker {worker} on {host} is waiting to join; the ranks add it "
                               "at their next commit")
            lost_events += self._try_form()
            deadline = time.monotonic() + self._join_budget()
            while not (self.generation > last_generation and worker in self.members
                       and worker not in self._waiting):
                if self.fatal:
                    raise ElasticJobError(self.fatal)
                if self.finished or self._closed:
                    # No generation forms any more: waiting on would hold this join (its
                    # store connection and thread) until its deadline, long after the job.
                    raise ElasticJobError("the elastic job has finished; no generation will form")
                if worker in self.lost:
                    raise ElasticJobError(f"worker {worker} was declared lost: {self.lost[worker]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ElasticJobError(
                        f"worker {worker} found no place in a generation within "
                        f"{self._join_budget():.0f} s (waiting: {sorted(self._waiting)}, "
                        f"members: {sorted(self.members)})")
                self._cond.wait(min(left, _CHECK_PERIOD_S))
                lost_events += self._try_form()
            assignment = Assignment(self.generation, self.members[worker], self._formed_version)
        self._notify_lost(lost_events)
        return {"generation": assignment.generation, "version": assignment.version,
                **dataclasses.asdict(assignment.info)}

    def current_version(self) -> int:
        """The hosts version: higher than a generation's when workers wait to join it."""
        with self._cond:
            return self.version

    def beat(self, worker: str, generation: int) -> str | None:
        """Record a heartbeat; return why ``generation`` is broken (the worker aborts), or None."""
        with self._cond:
            self._heartbeats.touch(worker)
            if self.fatal:
                return self.fatal
            if generation and generation == self.generation and self._broken:
                return self._broken
            if worker in self.lost:
                return f"this worker was declared lost: {self.lost[worker]}"
            return None

    # ------------------------------------------------------------------ launcher events

    def worker_started(self, worker: str, host: str) -> None:
        """A launcher started ``worker`` on ``host`` (it will join soon)."""
        with self._cond:
            self._register(worker, host)

    def worker_exited(self, worker: str, returncode: int) -> None:
        """``worker``'s process ended; code 0 by a member means training finished."""
        if returncode == 0:
            with self._cond:
                if worker in self.members and self._broken is None:
                    self.finished = True
                self._alive.pop(worker, None)
                self._waiting.discard(worker)
                self._cond.notify_all()
            return
        self.worker_lost(worker, f"exited with code {returncode}")

    def worker_lost(self, worker: str, reason: str) -> None:
        """Declare ``worker`` lost: its generation breaks and forms again without it."""
        with self._cond:
            events = self._lose(worker, reason)
            events += self._try_form()
        self._notify_lost(events)

    def close(self) -> None:
        """Stop the heartbeat checker and wake every waiting join."""
        with self._cond:
            self._closed = True
            if self.fatal is None and not self.finished:
                self.fatal = "the elastic job was stopped by its launcher"
            self._cond.notify_all()
        self._heartbeats.close()

    def fail(self, reason: str) -> None:
        """End the job: every join and heartbeat gets ``reason``."""
        with self._cond:
            if self.fatal is None:
                self.fatal = reason
                self._on_event(f"elastic job failed: {reason}")
            self._cond.notify_all()

    @property
    def alive(self) -> dict[str, str]:
        """Live workers and their hosts."""
        with self._cond:
            return dict(self._alive)

    # ------------------------------------------------------------------ internals

    def _register(self, worker: str, host: str) -> None:
        if worker not in self._alive and worker not in self.lost:
            self._alive[worker] = host
            self._arrival.setdefault(worker, len(self._arrival))
            self._cond.notify_all()

    def _join_budget(self) -> float:
        s = self.settings
        return (s.start_timeout_s if self.generation == 0 else 0.0) + 2 * s.elastic_timeout_s + 10.0

    def _break(self, reason: str, by_loss: bool = True) -> None:
        """Mark the current generation broken; a loss's reason beats a rank's leaving,
        which is usually that loss seen from a survivor a moment earlier."""
        if self._broken is None:
            self._broken_at = time.monotonic()
        if self._broken is None or (by_loss and not self._broken_by_loss):
            self._broken = reason
            self._broken_by_loss = by_loss
            self._cond.notify_all()

    def _lose(self, worker: str, reason: str) -> list[tuple[str, str]]:
        if worker not in self._alive:
            return []
        host = self._alive.pop(worker)
        self.lost[worker] = f"on {host} {reason}"
        self._waiting.discard(worker)
        self._heartbeats.forget(worker)
        if worker in self.members and not self.finished:
            rank = self.members[worker].rank
            who = f"worker {worker}{self._labels.get(worker, '')} on {host}"
            self._break(f"rank {rank} ({who}) {reason}")
            self._on_event(f"rank {rank} ({who}) lost: {reason}")
        self._cond.notify_all()
        return [(worker, reason)]

    def _try_form(self) -> list[tuple[str, str]]:
        """Form the next generation when its members are known; called under the lock."""
        s = self.settings
        events: list[tuple[str, str]] = []
        if self.fatal or self.finished:
            return events
        now = time.monotonic()
        ready = [w for w in self._alive if w in self._waiting]
        if self.generation == 0:
            waited = now - self._started
            started = len(self._alive)
            # A worker lost before the first ring formed is not waited for: start with
            # the rest once every live worker is ready (and at least min_np are).
            rest_ready = bool(self.lost) and len(ready) == started >= s.min_np
            if len(ready) < min(s.num_proc, s.max_np) and not rest_ready:
                if waited < s.start_timeout_s:
                    return events
                if started < s.min_np:
                    self.fail(f"only {started} of the {s.num_proc} workers started within "
                              f"the start timeout of {s.start_timeout_s:g} s "
                              f"(min_np={s.min_np})")
                    return events
                # As in Horovod, the start timeout bounds the tasks' start, not what a
                # started worker's process does before init() (importing its framework):
                # those get the elastic timeout on top.
                if len(ready) < started and waited < s.start_timeout_s + s.elastic_timeout_s:
                    return events
            if len(ready) < s.min_np:
                self.fail(f"only {len(ready)} of the {started} started workers called init() "
                          f"within the start timeout of {s.start_timeout_s:g} s and the "
                          f"elastic timeout of {s.elastic_timeout_s:g} s after it "
                          f"(min_np={s.min_np})")
                return events
        else:
            if self._broken is None:
                return events
            stragglers = [w for w in self.members if w in self._alive and w not in self._waiting]
            if stragglers:
                if now - self._broken_at < s.elastic_timeout_s:
                    return events
                for worker in stragglers:
                    events += self._lose(worker, (
                        "did not rejoin within the elastic timeout of "
                        f"{s.elastic_timeout_s:.0f} s"))
                ready = [w for w in self._alive if w in self._waiting]
            if len(ready) < s.min_np:
                if now - self._broken_at < s.elastic_timeout_s:
                    return events  # replacements may still come
                lost = "; ".join(f"worker {w} {why}" for w, why in self.lost.items())
                self.fail(f"only {len(ready)} workers are left, fewer than min_np={s.min_np}, "
                          f"after waiting {s.elastic_timeout_s:.0f} s; lost: {lost or 'none'}")
                return events
            if s.reset_limit is not None and self.resets >= s.reset_limit:
                self.fail(f"the ring was re-formed {self.resets} times, reaching reset_limit="
                          f"{s.reset_limit}; last cause: {self._broken}")
                return events
            self.resets += 1
        self._form(ready)
        return events

    def _form(self, ready: list[str]) -> None:
        previous = self.members
        # Survivors first, in their old rank order (rank 0's state is what others sync
        # from), then newcomers in arrival order.
        order = sorted(ready, key=lambda w: (
            0 if w in previous else 1,
            previous[w].rank if w in previous else self._arrival.get(w, 0)))
        chosen = order[: self.settings.max_np]
        infos = with_master(assign_ranks([TaskSlot(i, self._alive[w])
                                          for i, w in enumerate(chosen)]),
                            {i: self._endpoints.get(w) for i, w in enumerate(chosen)})
        self.members = {w: infos[i] for i, w in enumerate(chosen)}
        self.generation += 1
        self._waiting -= set(chosen)
        cause, self._broken = self._broken, None
        self._formed_version = self.version
        for worker in chosen:
            self._heartbeats.touch(worker)  # the clock restarts with the new ring
        hosts = sorted({info.host for info in self.members.values()})
        line = (f"generation {self.generation}: {len(chosen)} ranks on {len(hosts)} host(s)")
        if cause:
            line += f" after: {cause}"
        self._on_event(line)
        self._cond.notify_all()

    def _on_checked(self, silent: list[tuple[str, float]]) -> None:
        """After each heartbeat check: lose the silent workers together, then try to form."""
        events: list[tuple[str, str]] = []
        with self._cond:
            for worker, seconds in silent:
                events += self._lose(worker, (
                    f"sent no heartbeat for {seconds:.0f} s (its process or executor died "
                    "or froze, or its host is unreachable)"))
            events += self._try_form()
        self._notify_lost(events)

    def _notify_lost(self, events: list[tuple[str, str]]) -> None:
        for worker, reason in events:
            try:
                self._on_lost(worker, reason)
            except Exception:  # noqa: BLE001 - a launcher callback must not stop the driver
                log.exception("on_lost callback failed for worker %s", worker)
