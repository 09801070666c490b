"""One row per injected fault, read off the soak's events, and the table they make.

- detected: the first sign on the driver or the ranks (a cancelled job, a retry, an
  elastic reset, the job's error) after the fault and before the next one;
- went on: the first training step after that (or after the fault, when nothing was
  detected: the fault was absorbed), or the job's end with its named error;
- lost: steps done before the fault that were done again (an elastic loop back to its
  last commit, a fit back to its last checkpoint), or a DDP job's steps when it ended.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hvd_spark.bench.chaos.events import Event, Events
from hvd_spark.bench.chaos.faults import Injected


@dataclasses.dataclass
class Row:
    """The account of one fault (seconds are from its injection)."""

    fault: Injected
    at: float  # seconds since the workload started
    detected: float | None
    went_on: float | None
    ended: str | None
    lost: int | None


def _last_step(steps: Sequence[Event], before: float) -> int | None:
    done = [e.n for e in steps if e.at < before]
    return max(done) if done else None


def _went_on_from(steps: Sequence[Event], fault: Injected, detected: float | None
                  ) -> list[Event]:
    """Steps from the one that shows training went on. After a detected fault: the first
    after the detection. Undetected, a fault with a duration may still have stalled the
    ranks (a link down): then the first step after its end; steps all through it mean
    training never stopped (steps already on the wire as it began do not count)."""
    if detected is not None:
        return [e for e in steps if e.at > detected]
    if fault.duration > 1.0:
        inside = [e for e in steps if fault.at + 0.5 < e.at < fault.at + fault.duration - 0.5]
        if not inside:
            return [e for e in steps if e.at >= fault.at + fault.duration - 0.5]
    return [e for e in steps if e.at > fault.at]


def rows(events: Events, injected: Sequence[Injected], started: float) -> list[Row]:
    """The rows of ``injected``, each fault's window ending where the next one begins."""
    out = []
    steps = events.since(0.0, "step")
    for k, fault in enumerate(injected):
        end = injected[k + 1].at if k + 1 < len(injected) else float("inf")
        signs = [e for e in events.since(fault.at) if e.at < end
                 and e.kind in ("detected", "reset", "ended")]
        detected = signs[0].at if signs else None
        ended = next((e for e in events.since(fault.at, "ended") if e.at < end), None)
        after = _went_on_from(steps, fault, detected)
        if detected is not None and not after and ended is None:
            # A sign with no step after it, while steps followed the fault: training went
            # on, and the sign is the last ring's teardown as the run ends, not this fault's.
            through = _went_on_from(steps, fault, None)
            if through and through[0].at < detected:
                detected, after = None, through
        went_on = after[0] if after and (ended is None or after[0].at < ended.at) else None
        before = _last_step(steps, went_on.at if went_on else (ended.at if ended else end))
        if detected is None:
            lost = 0  # absorbed: no rank lost its place (a new job's steps restart at 1)
        elif ended is not None and went_on is None:
            lost = _last_step([e for e in steps if e.at > fault.at - 600], ended.at)
        elif went_on is not None and before is not None:
            lost = max(0, before - (went_on.n - 1))
        else:
            lost = None
        out.append(Row(fault, fault.at - started,
                       None if detected is None else detected - fault.at,
                       None if went_on is None else went_on.at - fault.at,
                       None if ended is None else ended.text, lost))
    return out


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(found: Sequence[Row]) -> list[str]:
    """Fixed-width lines: one header, one line per fault."""
    head = (f"{'#':>2} {'kind':<14} {'where':<22} {'at s':>6} {'detect s':>8} "
            f"{'on s':>6} {'lost':>4}  outcome")
    lines = [head, "-" * len(head)]
    for k, r in enumerate(found, 1):
        kind = r.fault.kind + ("*" if r.fault.in_recovery else "")
        if r.ended:
            outcome = f"job ended: {r.ended}"
        elif r.went_on is not None:
            outcome = "went on" if r.detected is not None else "absorbed, went on"
        else:
            outcome = "no step after it"
        lines.append(f"{k:>2} {kind:<14} {r.fault.where:<22} {r.at:>6.1f} "
                     f"{_s(r.detected):>8} {_s(r.went_on):>6} "
                     f"{'-' if r.lost is None else r.lost:>4}  {outcome[:110]}")
    lines.append("* injected while the cluster recovered from the fault before it")
    return lines
