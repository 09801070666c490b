"""The soak's plan of faults (seeded) and the thread that injects them as training goes.

Fault ``k`` lands once training has made ``gap`` more steps after fault ``k-1`` settled
(training went on, or the job ended), on a random host and victim; a fault drawn
``in-recovery`` instead lands as soon as the previous one was detected, before
training went on again. Every wait is bounded by the soak's deadline.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hvd_spark.bench.chaos import faults
from hvd_spark.bench.chaos.events import Events

if TYPE_CHECKING:
    from netns_cluster.hosts import NetnsHosts

#: How long a fault waits for a victim (a rank that a retry is starting) before giving up.
TARGET_WAIT_S = 30.0
#: How long after a fault that nothing detected training must still step to call it absorbed.
DETECT_GRACE_S = 12.0


@dataclasses.dataclass(frozen=True)
class Planned:
    """One fault of the plan: its kind, the steps of training before it, and for an
    in-recovery fault the seconds after the previous one's detection."""

    kind: str
    gap: int
    in_recovery: bool = False
    delay: float = 0.0


def plan(rng: random.Random, count: int, kinds: Sequence[str], gap: tuple[int, int],
         in_recovery: bool = True) -> list[Planned]:
    """``count`` faults drawn from ``kinds`` (and, after the first, ``in-recovery``)."""
    drawn = []
    for k in range(count):
        choices = [*kinds, faults.IN_RECOVERY] if in_recovery and k > 0 else list(kinds)
        kind = rng.choice(choices)
        steps = rng.randint(*gap)
        if kind == faults.IN_RECOVERY:
            drawn.append(Planned(rng.choice(list(kinds)), 0, True, rng.uniform(0.0, 2.0)))
        else:
            drawn.append(Planned(kind, steps))
    return drawn


class Injector(threading.Thread):
    """Injects ``planned`` faults into ``net`` as ``events`` show training going on.

    Attributes:
        injected: The faults injected so far, in order.
        notes: Faults that could not be injected, and why.
    """

    def __init__(self, net: NetnsHosts, events: Events, planned: Sequence[Planned],
                 rng: random.Random, deadline: float, workload_done: threading.Event) -> None:
        super().__init__(daemon=True, name="chaos-injector")
        self.net, self.events, self.planned, self.rng = net, events, list(planned), rng
        self.deadline, self.workload_done = deadline, workload_done
        self.injected: list[faults.Injected] = []
        self.notes: list[str] = []
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._timers: list[threading.Timer] = []

    # ------------------------------------------------------------------ waiting
    def _over(self) -> bool:
        return (self._stopping.is_set() or self.workload_done.is_set()
                or time.time() > self.deadline)

    def _detected(self, fault: faults.Injected) -> float | None:
        found = [e.at for e in self.events.since(fault.at) if e.kind in ("detected", "reset",
                                                                          "ended")]
        return found[0] if found else None

    def _settled(self, fault: faults.Injected) -> float | None:
        """When training went on after ``fault`` (or its job ended), None while not yet.

        Undetected, a fault counts as absorbed only once training still steps
        ``DETECT_GRACE_S`` after it (a lost executor can take seconds to be noticed).
        """
        ended = [e.at for e in self.events.since(fault.at, "ended")]
        if ended:
            return ended[0]
        seen = self._detected(fault)
        after = (max(seen, fault.at + fault.duration) if seen is not None
                 else fault.at + max(fault.duration, DETECT_GRACE_S))
        steps = self.events.since(after, "step")
        return steps[0].at if steps else None

    def _wait(self, ready) -> object:
        while not self._over():
            value = ready()
            if value:
                return value
            self.events.wait(0.2)
        return None

    # ------------------------------------------------------------------ injecting
    def _inject(self, p: Planned) -> faults.Injected | None:
        kind_fn = faults.KINDS[p.kind]
        until = time.time() + TARGET_WAIT_S
        while True:
            try:
                fault = kind_fn(self.net, self.rng)
                break
            except faults.NoTarget as err:
                if time.time() > until or self._over():
                    self.notes.append(f"{p.kind}: nothing to act on ({err} not running)")
                    return None
                time.sleep(0.2)
        if fault.duration:
            timer = threading.Timer(fault.duration, fault.undo)
            timer.daemon = True
            timer.start()
            self._timers.append(timer)
        return fault

    def run(self) -> None:
        try:
            for p in self.planned:
                if not self._one(p):
                    break
        except Exception as err:  # noqa: BLE001 - reported by the soak: never a silent stop
            self.error = err
        finally:
            self.stop_faults()

    def _one(self, p: Planned) -> bool:
        last = self.injected[-1] if self.injected else None
        in_recovery = False
        if p.in_recovery and last is not None:
            if self._wait(lambda: self._detected(last) or self._settled(last)) is None:
                return False
            time.sleep(p.delay)
            # In a recovery only if the last fault was noticed and training has not resumed.
            seen = self._detected(last)
            in_recovery = seen is not None and not self.events.since(seen, "step")
        else:
            # The gap counts from the last fault, and its effect must have ended first.
            if last is not None and self._wait(lambda: self._settled(last)) is None:
                return False
            since = last.at if last is not None else 0.0
            if self._wait(lambda: len(self.events.since(since, "step")) >= max(1, p.gap)
                          ) is None:
                return False
        if self._over():
            return False
        fault = self._inject(p)
        if fault is not None:
            fault.in_recovery = in_recovery
            if p.in_recovery and not in_recovery:
                self.notes.append(f"fault {len(self.injected) + 1} ({fault.kind}) was drawn to "
                                  "land in a recovery, but the fault before it was absorbed "
                                  "or training had gone on")
            self.injected.append(fault)
        return True

    def stop_faults(self) -> None:
        """End every fault still in effect now (resume, link up, qdisc off, shm emptied)."""
        for timer in self._timers:
            timer.cancel()
        for fault in self.injected:
            fault.undo()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop injecting, end the faults in effect and wait for the thread."""
        self._stopping.set()
        self.join(timeout)
        self.stop_faults()

    def wait_last_settled(self, timeout: float) -> None:
        """Wait (bounded) until the last fault's effect ended, so checks see the after."""
        if self.injected:
            last = self.injected[-1]
            end = min(time.time() + timeout, self.deadline)
            while time.time() < end and time.time() < last.at + last.duration:
                time.sleep(0.2)
