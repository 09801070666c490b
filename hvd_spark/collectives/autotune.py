"""Autotuning of the engine's fusion threshold, cycle time and ring chunk size (rank 0).

``HVD_SPARK_AUTOTUNE=1`` (or Horovod's ``HOROVOD_AUTOTUNE``) puts an ``Autotuner`` on
rank 0's engine. It scores parameter sets by measured throughput, as Horovod's
parameter manager does: bytes of the collectives that rank 0 sent out, divided by the
wall time of a *sample* (``steps_per_sample`` training steps, a step ending where a
tensor name comes round again). The first samples are warm-up and discarded, as is the
first sample after each switch (it straddles two settings); a candidate's score is the
median of its samples.

The search (``CoordinateSearch``) scans one parameter at a time over a small grid,
starting from the configured values, the others held at the best so far. A scan's best
value is adopted only when it beats the current one by more than ``margin`` and by more
than the spread of the samples behind either score (half their range, relative): on a
busy machine nothing moves. A full scan rather than a hill climb, because throughput is
not always monotonic along a grid (2 MiB chunks may gain nothing where 4 MiB gain 20%).
Before freezing a choice that differs from the start, both are measured once more, back
to back, and the start wins unless the choice still beats it by that much: a tuned run
is not slower than the defaults by more than noise. After at most ``max_candidates``
candidates the best is frozen and logged; from then on the tuner costs nothing.

Values the user set explicitly are not tuned (Horovod's rule too). The chunk size must
be the same on every rank: it travels with the responses (``Response.chunk_bytes``).
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import statistics
from collections.abc import Generator, Iterable, Sequence

from hvd_spark.config import AUTOTUNE_MAX_CHUNK_BYTES, AutotuneConfig

log = logging.getLogger(__name__)

#: Candidate values per parameter (the configured default is always among them).
FUSION_GRID = tuple(mb << 20 for mb in (4, 16, 32, 64, 128))
CYCLE_GRID = (0.0, 0.5, 1.0, 2.5, 5.0)
#: The largest chunk is the shared-memory slot size while the chunk is tuned.
CHUNK_GRID = (256 << 10, 512 << 10, 1 << 20, 2 << 20, AUTOTUNE_MAX_CHUNK_BYTES)
# A sample of tensors whose names never repeat still ends after this many responses.
_MAX_RESPONSES_PER_SAMPLE = 1000
# The order of the scans: the chunk moved throughput most in measurements, cycle least.
_AXES = ("chunk_bytes", "fusion_threshold", "cycle_time_ms")


@dataclasses.dataclass(frozen=True)
class Params:
    """One setting of the tuned parameters."""

    fusion_threshold: int
    cycle_time_ms: float
    chunk_bytes: int

    def describe(self) -> str:
        """``fusion_threshold=64 MiB, cycle_time_ms=1, chunk_bytes=1024 KiB``."""
        return (f"fusion_threshold={self.fusion_threshold / (1 << 20):g} MiB, "
                f"cycle_time_ms={self.cycle_time_ms:g}, "
                f"chunk_bytes={self.chunk_bytes >> 10} KiB")


def grids(start: Params, fixed: Iterable[str], tune_chunk: bool) -> dict[str, tuple]:
    """The values to try per parameter: the grid with the start value in it, or just the
    start value for a parameter the user fixed (or the chunk, where it cannot change)."""
    full = {"fusion_threshold": FUSION_GRID, "cycle_time_ms": CYCLE_GRID,
            "chunk_bytes": CHUNK_GRID}
    out = {}
    for name, grid in full.items():
        value = getattr(start, name)
        frozen = name in fixed or (name == "chunk_bytes" and not tune_chunk)
        out[name] = (value,) if frozen else tuple(sorted({*grid, value}))
    return out


class CoordinateSearch:
    """Coordinate search over ``grids``, one parameter at a time (pure: no clock, no I/O).

    Call ``candidate()`` for the parameters to measure next, then ``report(score)``
    with their score (higher is better); ``candidate()`` is None once done, and
    ``best`` holds the choice.

    Args:
        start: The configured parameters; measured first, and kept unless beaten.
        grids: Per parameter name of ``Params``, its values in ascending order.
        margin: Relative improvement a candidate needs over the best to be adopted.
        max_candidates: Most candidates measured (the final check included).
    """

    def __init__(self, start: Params, grids: dict[str, Sequence], margin: float = 0.05,
                 max_candidates: int = 20) -> None:
        self.start = start
        self.grids = {k: tuple(v) for k, v in grids.items()}
        self.margin = margin
        self.max_candidates = max(1, max_candidates)
        self.best = start
        self.best_score = 0.0
        #: Every (params, score, phase) reported, in order.
        self.history: list[tuple[Params, float, str]] = []
        self._phase = "start"
        self._noise = 0.0  # of the last report
        self._plan = self._steps()
        tunable = any(len(g) > 1 for g in self.grids.values())
        # With nothing to tune there is nothing to measure.
        self._next: Params | None = next(self._plan) if tunable else None

    def candidate(self) -> Params | None:
        """The parameters to measure next, or None when the search is over."""
        return self._next

    @property
    def done(self) -> bool:
        """True once ``best`` is final."""
        return self._next is None

    def report(self, score: float, noise: float = 0.0) -> None:
        """The score of the last ``candidate()``.

        Args:
            score: Its throughput (higher is better).
            noise: Relative spread of the measurements behind ``score`` (e.g. half their
                range over their median): a gain must exceed it as well as ``margin``.
        """
        if self._next is None:
            raise RuntimeError("the search is over; nothing was asked")
        self.history.append((self._next, score, self._phase))
        self._noise = noise
        try:
            self._next = self._plan.send(score)
        except StopIteration:
            self._next = None

    def _beats(self, score: float, other: float, noise: float = 0.0) -> bool:
        return score > other * (1.0 + max(self.margin, noise))

    def _steps(self) -> Generator[Params, float, None]:
        self.best_score = yield self.start
        best_noise = self._noise
        budget = self.max_candidates - 1
        reserve = 2 if self.max_candidates >= 4 else 0  # for the final check
        for axis in _AXES:
            grid = self.grids.get(axis, ())
            if len(grid) < 2:
                continue
            # Nearest values first, so a budget cut short still looks around the start.
            i = grid.index(getattr(self.best, axis))
            others = [grid[j] for j in sorted(range(len(grid)), key=lambda j: (abs(j - i), j))
                      if j != i]
            self._phase = axis
            found, found_score, found_noise = self.best, self.best_score, best_noise
            for value in others:
                if budget <= reserve:
                    break
                budget -= 1
                trial = dataclasses.replace(self.best, **{axis: value})
                score = yield trial
                if score > found_score:
                    found, found_score, found_noise = trial, score, self._noise
            if self._beats(found_score, self.best_score, max(found_noise, best_noise)):
                self.best, self.best_score, best_noise = found, found_score, found_noise
        if self.best == self.start or reserve == 0:
            if reserve == 0 and not self._beats(self.best_score, self.history[0][1]):
                self.best = self.start
            return
        # Conditions drift (other jobs, thermal, the data): compare again, back to back.
        self._phase = "check"
        start_score = yield self.start
        start_noise = self._noise
        best_score = yield self.best
        if self._beats(best_score, start_score, max(start_noise, self._noise)):
            self.best_score = best_score
        else:
            self.best, self.best_score = self.start, start_score


class Autotuner:
    """Rank 0's sampler around a ``CoordinateSearch``: feed it each batch of responses.

    Args:
        config: The autotune settings.
        start: The engine's configured parameters.
        fixed: Names of parameters the user set (kept as they are).
        tune_chunk: Whether the backend can change its chunk size mid-run.
    """

    def __init__(self, config: AutotuneConfig, start: Params, fixed: Iterable[str] = (),
                 tune_chunk: bool = True) -> None:
        self.config = config
        self.search = CoordinateSearch(start, grids(start, fixed, tune_chunk), config.margin,
                                       config.max_candidates)
        self.current = start
        self._skip = config.warmup_samples  # samples to discard before the next score
        self._scores: list[float] = []
        self._counts: dict[str, int] = {}
        self._responses = 0
        self._bytes = 0
        self._since: float | None = None
        self.samples = 0
        self._log = _CsvLog(config.log_path) if config.log_path else None
        if self.search.done:
            self._finish()

    @property
    def done(self) -> bool:
        """True once the parameters are frozen."""
        return self.search.done

    def observe(self, names: Sequence[str], nbytes: int, now: float) -> Params | None:
        """Account one batch of responses sent at ``now``.

        Args:
            names: Tensor names the batch covers.
            nbytes: Their bytes.
            now: ``time.monotonic()``.

        Returns:
            New parameters to switch to from the next responses on, or None.
        """
        if self.search.done:
            return None
        if self._since is None:
            self._since = now
        if self._sample_ends(names):
            change = self._close_sample(now)
            self._counts = dict.fromkeys(names, 1)
            self._responses, self._bytes = 1, nbytes
            return change
        self._responses += 1
        self._bytes += nbytes
        return None

    def _sample_ends(self, names: Sequence[str]) -> bool:
        steps = self.config.steps_per_sample
        ends = self._responses >= _MAX_RESPONSES_PER_SAMPLE
        for name in names:
            seen = self._counts.get(name, 0) + 1
            self._counts[name] = seen
            ends = ends or seen > steps
        return ends

    def _close_sample(self, now: float) -> Params | None:
        elapsed, self._since = now - self._since, now
        self.samples += 1
        if self._skip > 0:
            self._skip -= 1
            return None
        self._scores.append(self._bytes / max(elapsed, 1e-9))
        if len(self._scores) < self.config.samples:
            return None
        score = statistics.median(self._scores)
        # Half the samples' range, relative: on a shared machine a gain must beat it.
        noise = (max(self._scores) - min(self._scores)) / (2 * score) if score > 0 else 0.0
        self._scores = []
        self.search.report(score, noise)
        if self._log is not None:
            self._log.row(self.search.history[-1])
        nxt = self.search.candidate()
        if nxt is None:
            return self._finish()
        self._skip = 1  # the next sample straddles the switch
        return self._switch(nxt)

    def _switch(self, params: Params) -> Params | None:
        if params == self.current:
            return None
        self.current = params
        return params

    def _finish(self) -> Params | None:
        search = self.search
        start_scores = [s for p, s, _ in search.history if p == search.start]
        base = f"{statistics.median(start_scores) / 1e6:.1f} MB/s" if start_scores else "-"
        if search.best == search.start:
            log.info("autotune kept the configured parameters (%s): no candidate beat them "
                     "by more than %.0f%% (%s) after %d samples", search.best.describe(),
                     100 * search.margin, base, self.samples)
        else:
            log.info("autotune chose %s: %.1f MB/s vs %s with the configured %s, after %d "
                     "samples", search.best.describe(), search.best_score / 1e6, base,
                     search.start.describe(), self.samples)
        if self._log is not None:
            self._log.row((search.best, search.best_score, "chosen"))
            self._log.close()
        return self._switch(search.best)


class _CsvLog:
    """HOROVOD_AUTOTUNE_LOG: one row per scored candidate, then the choice."""

    FIELDS = ("fusion_threshold_bytes", "cycle_time_ms", "chunk_bytes", "score_bytes_per_s",
              "phase")

    def __init__(self, path: str) -> None:
        self._file = open(path, "w", newline="", encoding="utf-8")  # noqa: SIM115 - kept open
        self._writer = csv.writer(self._file)
        self._writer.writerow(self.FIELDS)
        self._file.flush()

    def row(self, entry: tuple[Params, float, str]) -> None:
        params, score, phase = entry
        self._writer.writerow((params.fusion_threshold, params.cycle_time_ms,
                               params.chunk_bytes, f"{score:.0f}", phase))
        self._file.flush()

    def close(self) -> None:
        self._file.close()
