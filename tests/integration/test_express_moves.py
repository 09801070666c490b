"""Small broadcasts and allgathers that two ranks decide alone (``pairing``), the
synchronous ones on the caller's thread (``tcp.express_moves``).

Real processes and sockets (``run_local``). Each rank picks at random, per call,
whether it calls synchronously or asynchronously, so the express path meets the usual
path on the other rank in every combination, from several threads and with one rank
late; every result is checked against numpy and bitwise across the ranks.
"""

from __future__ import annotations

import numpy as np
import pytest

from hvd_spark.collectives.engine_core import DRIVE_SLICE_S
from hvd_spark.runner import run_local
from tests.integration import express_move_jobs as jobs

ENV = {"HVD_SPARK_TIMEOUT": "20"}


def _check(outs: list[dict], seed: int, threads: int, count: int) -> None:
    for t in range(threads):
        for step, spec in enumerate(jobs.plan(seed, t, count)):
            want = jobs.reference(spec, step)
            got = [outs[r]["results"][t][step] for r in (0, 1)]
            where = f"seed {seed} thread {t} step {step} {spec}"
            for r, value in enumerate(got):
                assert isinstance(value, np.ndarray), f"rank {r} {where}: {value}"
                assert value.dtype == want.dtype and value.shape == want.shape, (r, where)
            np.testing.assert_array_equal(got[0].astype(np.float64),
                                          want.astype(np.float64), err_msg=where)
            assert got[0].tobytes() == got[1].tobytes(), f"ranks differ: {where}"


@pytest.mark.parametrize("seed,threads,slow_rank,delay_s", [
    (1, 1, None, 0.0), (2, 3, None, 0.0), (3, 1, 1, 1.5 * DRIVE_SLICE_S), (4, 1, 0, 0.01),
    (5, 2, 0, 0.01),
], ids=["one thread", "three threads", "rank 1 late", "rank 0 a little late",
        "two threads, rank 0 a little late"])
def test_small_moves_pair_exactly_on_every_mix_of_paths(seed, threads, slow_rank, delay_s):
    count = 40 if slow_rank is None else 12
    outs = run_local(jobs.move_rounds, args=(seed, threads, count, slow_rank, delay_s),
                     num_proc=2, env=ENV)
    _check(outs, seed, threads, count)
    for r, out in enumerate(outs):
        # Most calls are decided by the two ranks alone. With one thread some of them
        # run express (but not on a rank that always waits longer than a slice: it
        # hands each call over); with several, a call that finds another thread's in
        # flight takes the usual path by design, which a late rank makes the rule.
        assert out["paired"] >= threads * count // 2, f"rank {r}: {out['paired']}"
        if threads == 1 and (slow_rank != 1 or r == 1):
            assert out["express"] > 0, f"rank {r}: no express call"
    if slow_rank == 1:
        assert outs[0]["fallbacks"] > 0, "rank 0 never handed a late call over"


def test_ranks_that_disagree_on_a_move_both_fail_alike_promptly_and_go_on():
    outs = run_local(jobs.disagreeing_moves, num_proc=2, env=ENV)
    for what, i in (("root_rank", 0), ("shape", 1), ("shape after dim 0", 2), ("dtype", 3)):
        texts = [out["errors"][i] for out in outs]
        assert texts[0] is not None and texts[0] == texts[1], texts
        assert f"disagree on the {what} of collective" in texts[0], texts[0]
    for out in outs:
        assert max(out["seconds"]) < 5.0, out["seconds"]
        assert out["after"] == [[0, 1]] * 4


def test_torch_synchronous_broadcast_and_allgather_take_the_express_path():
    count = 6
    outs = run_local(jobs.torch_moves, args=(count,), num_proc=2, env=ENV)
    for i in range(count):
        base = [np.arange(12, dtype=np.float32).reshape(3, 4) + 10 * r + i for r in (0, 1)]
        want_b = base[i % 2].tolist()
        want_g = np.concatenate([base[0][:1], base[1][:2]]).tolist()
        for r, out in enumerate(outs):
            b, c, strided, g = out["results"][i]
            assert b == want_b and c == base[1].tolist(), (r, i)
            assert strided == base[0].T.tolist() and g == want_g, (r, i)
    for r, out in enumerate(outs):
        # broadcast, broadcast_ (contiguous) and allgather: three of four calls a step.
        assert out["express"] >= 2 * count, f"rank {r}: {out['express']}"


def test_tensors_across_the_eager_limit_go_through_rank_0_and_still_agree():
    rounds = 6
    outs = run_local(jobs.sizes_across_the_eager_limit, args=(rounds,), num_proc=2, env=ENV)
    for i in range(rounds):
        rows = [12_000 if r == i % 2 else 10 for r in (0, 1)]
        want = np.concatenate([np.full((rows[r], 2), r, np.float32) for r in (0, 1)])
        for r, out in enumerate(outs):
            gathered, sent = out["results"][i]
            np.testing.assert_array_equal(gathered, want, err_msg=f"rank {r} round {i}")
            assert sent.dtype == np.float32 and (sent == 1).all(), (r, i)
    for out in outs:
        assert out["express"] > 0  # the agreeing synchronous broadcasts ran express
