"""The reader's shuffle buffer: decoded row groups in, equal-size shuffled batches out.

Each round merges the rows carried over from the last round, R (already in a uniformly
random order), with the next row group Q, and hands out as many whole batches as leave
``buffer_size // 2`` rows behind; those, a random subset, are the next round's R.

A uniformly random order of R and Q together: R's rows go to a random subset of the
positions, in their own (random) order, and Q's rows fill the other positions in a
random order. Columns of narrow rows (scalars) are concatenated and gathered in that
order with one ``np.take``. Wide rows (a vector of 784 float32 is 3 KB) skip the
concatenation: one ``np.take`` from Q fills the output and R's rows are written over
their positions, so each row is copied once instead of twice. ``np.take`` on
contiguous arrays releases the GIL, so this overlaps the decode threads and the
training loop.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

Batch = dict[str, np.ndarray]

# Rows at least this wide are gathered from the carried rows and the row group
# separately; narrower ones are concatenated first (fewer numpy calls per column).
_WIDE_ROW_BYTES = 256


def rebatch(
    parts: Iterator[Batch], batch_size: int, buffer_size: int, rng: np.random.Generator | None
) -> Iterator[Batch]:
    """Cut ``parts`` (column -> rows) into batches of ``batch_size`` rows.

    Args:
        parts: Decoded row groups, in reading order.
        batch_size: Rows per batch.
        buffer_size: Rows mixed together at least (a round starts once this many plus
            a batch are held); ``buffer_size // 2`` rows are carried to the next round.
        rng: Randomness of the shuffle; None keeps the reading order.

    Yields:
        Batches as views of larger arrays: copy one before changing it in place.
    """
    if rng is None:
        yield from _in_order(parts, batch_size)
        return
    keep = buffer_size // 2
    threshold = batch_size + buffer_size
    rest: Batch | None = None
    held = 0
    for part in parts:
        rows = _rows(part)
        if rows == 0:
            continue
        if held + rows < threshold:  # small row groups: join them first
            rest = _shuffled(part if rest is None else _joined([rest, part]), rng)
            held += rows
            continue
        count = (held + rows - keep) // batch_size
        out, rest = _round(rest, held, part, rows, count * batch_size, rng)
        held = held + rows - count * batch_size
        yield from _slices(out, batch_size, count)
    if rest is not None and held >= batch_size:
        yield from _slices(rest, batch_size, held // batch_size)  # already in random order


def _round(rest: Batch | None, held: int, part: Batch, rows: int, take: int,
           rng: np.random.Generator) -> tuple[Batch, Batch]:
    """``take`` rows of a random order of ``rest`` + ``part``, and the remaining rows."""
    total = held + rows
    from_rest = np.zeros(total, dtype=bool)
    if held:
        from_rest[rng.choice(total, held, replace=False)] = True
    # Where each position's row comes from, as an index into concat(rest, part): the
    # carried rows in their order, the part's rows in a random order.
    source = np.empty(total, dtype=np.intp)
    source[from_rest] = np.arange(held)
    source[~from_rest] = held + rng.permutation(rows)
    halves = [_Half(source[:take], from_rest[:take], held),
              _Half(source[take:], from_rest[take:], held)]
    out: Batch = {}
    kept: Batch = {}
    for name, values in part.items():
        carried = rest[name] if rest is not None else None
        if carried is None or values[:1].nbytes < _WIDE_ROW_BYTES:
            # Narrow rows: one concatenation and one gather cost the fewest numpy calls.
            # Indices are in range by construction: "clip" skips the bounds checks.
            column = values if carried is None else np.concatenate([carried, values])
            out[name], kept[name] = (np.take(column, h.source, axis=0, mode="clip")
                                     for h in halves)
        else:
            out[name], kept[name] = (h.gather(carried, values) for h in halves)
    return out, kept


class _Half:
    """The rows handed out (or kept) in a round, for gathering wide rows without a concat."""

    def __init__(self, source: np.ndarray, is_carried: np.ndarray, held: int) -> None:
        self.source = source
        carried_at = np.flatnonzero(is_carried)
        # Carried rows appear in their own order, so they are one contiguous slice.
        self.carried = slice(int(source[carried_at[0]]), int(source[carried_at[-1]]) + 1) \
            if len(carried_at) else slice(0, 0)
        self.carried_at = carried_at
        self.part_source = np.where(is_carried, 0, source - held)

    def gather(self, carried: np.ndarray, values: np.ndarray) -> np.ndarray:
        # One gather from the row group (carried positions get a placeholder), then the
        # carried rows written over their positions: each row is copied once.
        out = np.take(values, self.part_source, axis=0, mode="clip")
        out[self.carried_at] = carried[self.carried]
        return out


def _shuffled(batch: Batch, rng: np.random.Generator) -> Batch:
    order = rng.permutation(_rows(batch))
    return {k: np.take(v, order, axis=0, mode="clip") for k, v in batch.items()}


def _in_order(parts: Iterator[Batch], batch_size: int) -> Iterator[Batch]:
    pending: list[Batch] = []
    held = 0
    for part in parts:
        pending.append(part)
        held += _rows(part)
        if held < batch_size:
            continue
        joined = _joined(pending)
        count = held // batch_size
        yield from _slices(joined, batch_size, count)
        held -= count * batch_size
        pending = [{k: v[count * batch_size:] for k, v in joined.items()}] if held else []


def _joined(batches: list[Batch]) -> Batch:
    if len(batches) == 1:
        return batches[0]
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def _slices(batch: Batch, batch_size: int, count: int) -> Iterator[Batch]:
    for i in range(count):
        yield {k: v[i * batch_size:(i + 1) * batch_size] for k, v in batch.items()}


def _rows(batch: Batch) -> int:
    return len(next(iter(batch.values())))
