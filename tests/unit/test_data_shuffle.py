"""The shuffle buffer (pure numpy): every row once, columns aligned, seeded, well mixed."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_spark.data.shuffle import rebatch


def _parts(sizes):
    start = 0
    for n in sizes:
        ids = np.arange(start, start + n)
        # "wide" rows are narrow enough to be concatenated; "big" rows (320 bytes) take the
        # gather-without-concatenation path: both must keep rows aligned with "id".
        yield {"id": ids, "wide": np.stack([ids, -ids, 2 * ids], axis=1).astype(np.float32),
               "big": np.repeat(ids[:, None], 80, axis=1).astype(np.float32)}
        start += n


@pytest.mark.parametrize("sizes", [[100], [7, 3, 50, 1, 64, 9], [40] * 10, [0, 33, 0, 200]])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_row_once_in_whole_batches_with_columns_aligned(sizes, shuffle):
    rng = np.random.default_rng(3) if shuffle else None
    batches = list(rebatch(_parts(sizes), 8, 20, rng))
    ids = np.concatenate([b["id"] for b in batches])
    total = sum(sizes)
    assert all(len(b["id"]) == 8 for b in batches)
    assert len(batches) == total // 8 and len(set(ids.tolist())) == len(ids)
    assert set(ids.tolist()) <= set(range(total))
    for b in batches:
        np.testing.assert_array_equal(b["wide"], np.stack([b["id"], -b["id"], 2 * b["id"]], 1))
        np.testing.assert_array_equal(b["big"], np.repeat(b["id"][:, None], 80, axis=1))
    if not shuffle:
        assert ids.tolist() == list(range(len(ids)))


def test_seeded_and_mixing_across_row_groups():
    def run(seed):
        return [b["id"] for b in rebatch(_parts([1000] * 6), 50, 400, np.random.default_rng(seed))]

    a, b, c = run(1), run(1), run(2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    groups = [set((batch // 1000).tolist()) for batch in a]
    # Rows carried over from earlier row groups show up in later batches...
    assert sum(len(g) > 1 for g in groups) > len(groups) // 2
    # ...and a row group's rows are spread over many batches, not handed out in order.
    first = np.concatenate(a)
    assert not np.array_equal(first[:1000], np.sort(first[:1000]))


def test_carried_rows_land_uniformly_in_the_next_round():
    # Round 1 hands out 500 of row group 1's 600 rows and carries 100; round 2 mixes those
    # with row group 2 and hands out 600 of the 700. A carried row is handed out with
    # probability 6/7, at a uniformly random position: as often in either half.
    halves, handed = np.zeros(2, dtype=int), 0
    for seed in range(200):
        batches = list(rebatch(_parts([600, 600]), 100, 200, np.random.default_rng(seed)))
        second = np.concatenate([b["id"] for b in batches[5:11]])
        pos = np.flatnonzero(second < 600)
        handed += len(pos)
        halves += np.bincount(pos >= 300, minlength=2)
    assert abs(handed / (200 * 100) - 6 / 7) < 0.02
    assert abs(halves[0] - halves[1]) < 0.05 * halves.sum()
