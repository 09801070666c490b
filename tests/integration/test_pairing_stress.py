"""Two ranks deciding small allreduces alone (``pairing``): the fixed cases, then
randomized stress. The express path on top of it: test_express_pairs.py.

Real processes and sockets (``run_local``). Every result is checked against numpy and
bitwise across the ranks; a split decision (one rank alone, the other waiting for rank
0's coordinator) shows up as a wrong result, an engine failure or a timeout, so the
collective timeout is short here and the errors expected must come back in seconds.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from hvd_spark.runner import run_local
from tests.integration import pairing_jobs as jobs

# Short, so that a split decision fails the test in seconds rather than hanging it.
ENV = {"HVD_SPARK_TIMEOUT": "20", "HVD_SPARK_EAGER_BYTES": str(jobs.EAGER_BYTES)}
# Errors are decided by both ranks (or rank 0) at once: anything near the timeout is a hang.
PROMPT_S = 5.0


def _check_threaded(results: list[dict], seed: int, threads: int, steps: int) -> None:
    """Every thread's every result equals numpy's and is the same bits on both ranks."""
    plan = jobs.plan_threads(seed, threads, steps)
    for t in range(threads):
        for step, batch in enumerate(plan[t]):
            for i, spec in enumerate(batch):
                got = [results[r]["results"][t][step][i] for r in (0, 1)]
                where = f"seed {seed} thread {t} step {step} {spec}"
                for r, value in enumerate(got):
                    assert isinstance(value, np.ndarray), f"rank {r} {where}: {value}"
                want = jobs.reference(spec, step)
                np.testing.assert_array_equal(got[0], want, err_msg=where)
                assert got[0].dtype == want.dtype, where
                assert got[0].tobytes() == got[1].tobytes(), f"ranks differ: {where}"


def test_small_allreduces_pair_in_any_order_and_an_early_half_waits_for_the_late_one():
    outs = run_local(jobs.opposite_orders_and_late_halves, args=(30,), num_proc=2, env=ENV)
    for r, out in enumerate(outs):
        assert out["steps"] == [[20.0 * s + 2 * i + 1 for i in range(3)] for s in range(30)]
        assert out["paired"] == 90, f"rank {r} went through rank 0"
        for (text, seconds), name in zip(out["mixed"], ["mixed0.None", "mixed1.None",
                                                         "mixed0.0"]):
            assert name in text and "shape" in text and seconds < 5, (r, text, seconds)
        assert out["warm"] == [3.0, 3.0]
        assert out["late1"] == [3.0] and out["late0"] == [5.0]
        assert out["paired_late"] == 3, f"rank {r}"
    assert [t for t, _ in outs[0]["mixed"]] == [t for t, _ in outs[1]["mixed"]]


@pytest.mark.parametrize("seed,slow_rank", [(1, None), (2, 0), (3, 1)])
def test_threads_submitting_at_once_get_exact_equal_results(seed: int, slow_rank) -> None:
    threads, steps = 4, 60
    results = run_local(jobs.threaded_steps, args=(seed, threads, steps, slow_rank),
                        num_proc=2, env=ENV)
    _check_threaded(results, seed, threads, steps)
    # Most of these are small: the two ranks must have decided many alone, and each
    # rank counts only what both decided alone, so the counts agree.
    assert results[0]["paired"] == results[1]["paired"] > threads * steps // 2


def test_pairing_closing_and_reopening_with_a_timeline_midway(tmp_path) -> None:
    seed, threads, steps = 4, 3, 40
    path = str(tmp_path / "timeline.json")
    results = run_local(jobs.threaded_steps, args=(seed, threads, steps, 1, path),
                        num_proc=2, env=ENV)
    _check_threaded(results, seed, threads, steps)
    assert results[0]["paired"] == results[1]["paired"] > 0  # between the timelines
    assert (tmp_path / "timeline.json").stat().st_size > 0


def test_autotune_keeps_small_allreduces_exact() -> None:
    seed, threads, steps = 5, 2, 40
    env = {**ENV, "HVD_SPARK_AUTOTUNE": "1", "HVD_SPARK_AUTOTUNE_WARMUP_SAMPLES": "1",
           "HVD_SPARK_AUTOTUNE_STEPS_PER_SAMPLE": "2", "HVD_SPARK_AUTOTUNE_SAMPLES": "2"}
    results = run_local(jobs.threaded_steps, args=(seed, threads, steps, 0), num_proc=2,
                        env=env)
    _check_threaded(results, seed, threads, steps)
    assert results[0]["paired"] == results[1]["paired"]


@pytest.mark.parametrize("seed", [11, 12])
def test_mismatch_fails_both_ranks_promptly_and_the_name_runs_after(seed: int) -> None:
    rounds = 24
    outs = run_local(jobs.mismatched_then_good, args=(seed, rounds), num_proc=2, env=ENV)
    plan = jobs.plan_mixed(seed, rounds)
    for i, rnd in enumerate(plan):
        where = f"seed {seed} round {i} {rnd}"
        texts = [outs[r]["errors"][i][0] for r in (0, 1)]
        assert texts[0] == texts[1], where  # the same decision, word for word
        assert rnd["name"] in texts[0] and "Error" in texts[0], where
        what = {"size": "shape", "shape": "shape", "dtype": "dtype", "op": "reduce op"}
        assert what[rnd["how"]] in texts[0], where
        for r in (0, 1):
            assert outs[r]["errors"][i][1] < PROMPT_S, f"rank {r} waited: {where}"
        # The name's next use must not see anything left over from the failed one.
        spec = {"n": 5, "dtype": "float64", "op": "Sum", "prescale": 1.0, "postscale": 1.0}
        want = jobs.reference(spec, i)
        for r in (0, 1):
            np.testing.assert_array_equal(outs[r]["good"][i], want, err_msg=f"rank {r} {where}")


@pytest.mark.parametrize("seed", [21, 22])
def test_a_rank_joins_early_while_the_other_runs_small_allreduces(seed: int) -> None:
    rounds, per_round = 6, 8
    outs = run_local(jobs.early_join, args=(seed, rounds, per_round), num_proc=2, env=ENV)
    plan = random.Random(seed)
    for rnd in range(rounds):
        joiner = plan.randint(0, 1)
        worker = 1 - joiner
        want = []
        for i in range(per_round):
            v = 10.0 * rnd + i
            want.extend([[v + 1] * 3, [v] * 3] if i % 4 == 3 else [[v] * 3])
        # The joined rank contributes zeros: the lone rank gets its own values back.
        assert outs[worker]["alone"][rnd] == want, f"round {rnd}"
        assert outs[joiner]["alone"][rnd] == []
        assert outs[0]["last"][rnd] == outs[1]["last"][rnd] == worker
        together = [[200.0 * rnd + 2 * i + 1] * 2 for i in range(per_round)]
        for r in (0, 1):
            assert outs[r]["together"][rnd] == together, f"rank {r} round {rnd}"


def test_process_set_allreduces_interleaved_with_paired_ones() -> None:
    seed, steps = 31, 40
    outs = run_local(jobs.process_sets_mixed, args=(seed, steps), num_proc=2, env=ENV)
    for r, out in enumerate(outs):
        for step, got in enumerate(out["steps"]):
            want = {f"g.{k}": [2.0 * step + 4] * 4 for k in range(3)}
            want[f"solo{r}"] = [1.0 + step + 2 * r] * 4
            assert got == want, f"rank {r} step {step}"
    # Only the global ones pair; the process sets' go through rank 0.
    assert outs[0]["paired"] == outs[1]["paired"]
    assert 0 < outs[0]["paired"] <= 3 * steps
