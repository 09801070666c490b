"""The TCP engine's express allreduce (``Engine.express_allreduce``) on two real ranks.

A synchronous allreduce that two ranks decide alone runs on the caller's thread with
one frame each way; whenever something else turns up it hands over to the usual cycle.
Results are checked against numpy and bitwise across the ranks, and the engine's
counters show which path each call took.
"""

from __future__ import annotations

import numpy as np
import pytest

from hvd_spark.collectives.engine_core import DRIVE_SLICE_S
from hvd_spark.runner import run_local
from tests.integration import express_pair_jobs as jobs
from tests.integration import pairing_jobs

ENV = {"HVD_SPARK_TIMEOUT": "20"}


def _reference(spec: dict, step: int) -> np.ndarray:
    if spec["dtype"] == "bfloat16":  # inputs are small integers: exact in bfloat16
        want = pairing_jobs.reference(dict(spec, dtype="float32"), step)
        return want.astype(np.float64)
    return pairing_jobs.reference(spec, step).astype(np.float64)


def _check_results(outs: list[dict], count: int) -> None:
    limit = outs[0]["limit"]
    for i in range(count):
        spec = jobs.case_spec(i, limit)
        got = [outs[r]["results"][i] for r in (0, 1)]
        np.testing.assert_array_equal(got[0].reshape(-1), _reference(spec, i).reshape(-1),
                                      err_msg=f"call {i}: {spec}")
        assert got[0].tobytes() == got[1].tobytes(), f"ranks differ at call {i}: {spec}"


def test_synchronous_allreduces_of_every_kind_take_the_express_path_exactly():
    count = 70
    outs = run_local(jobs.express_rounds, args=(count,), num_proc=2, env=ENV)
    _check_results(outs, count)
    for r, out in enumerate(outs):
        # Nearly every call: one may meet a frame of the barrier or warm-up.
        assert out["express"] >= count // 2, f"rank {r}: {out['express']} express rounds"


def test_a_slow_peer_hands_the_wait_to_the_usual_path():
    """Rank 1 comes 120 ms late each time: rank 0 stops waiting on its own after a slice
    and the usual cycle finishes the call; rank 1 finds rank 0's request read already."""
    count = 4
    outs = run_local(jobs.express_rounds, args=(count, 1, 0.12), num_proc=2, env=ENV)
    _check_results(outs, count)
    assert outs[0]["fallbacks"] >= count - 1, outs[0]
    assert outs[1]["express"] >= count - 1, outs[1]


def test_an_express_call_waits_briefly_for_the_progress_lock():
    """After a pause between calls the background thread is unparked: the peer's request
    of the next call wakes it, and it holds the progress lock while it copies that
    tensor out of the lane. The call waits for the lock (2 ms here) and still runs
    express, with the request the thread read, instead of taking the usual path."""
    count = 6
    outs = run_local(jobs.calls_while_the_progress_lock_is_busy, args=(count, 0.002),
                     num_proc=2, env=ENV)
    for r, out in enumerate(outs):
        assert out["exact"], f"rank {r}: {out}"
        assert out["express"] >= count - 1, f"rank {r}: {out}"


def test_a_submission_from_another_thread_is_not_held_up_by_an_express_wait():
    """Rank 0 waits in an express allreduce that rank 1 reaches only after another of
    rank 0's threads submits ``x``: that submission is decided at once."""
    rounds = 6
    outs = run_local(jobs.submission_during_express, args=(rounds, 0.02), num_proc=2,
                     env=ENV)
    for out in outs:
        assert out["results"] == [(2.0 * k + 3, 2.0 * k + 3, 20.0 * k + 1)
                                  for k in range(rounds)]
    # The express wait gives up after 50 ms at the latest; woken, it hands over at once.
    quick = [s for s in outs[0]["x_seconds"] if s < 0.025]
    assert len(quick) >= rounds - 1, outs[0]["x_seconds"]
    assert outs[0]["fallbacks"] >= rounds - 1, outs[0]


# Above the inline limit (256 KB for two ranks) only the express lane carries a tensor.
LANE_LIMIT = (1 << 20) + 12  # odd element counts for 4- and 8-byte types
# Tensors this large take long enough to prepare that the background thread unparks
# between calls (and reads the peer's request of the next): express waits for it.
LARGER = (3 << 20) + 12


@pytest.mark.parametrize("limit", [LANE_LIMIT, LARGER], ids=["1MB", "3MB"])
def test_tensors_up_to_the_lane_size_cross_shared_memory_exactly(limit):
    """Every dtype and op again, a quarter of the calls 1 MB (or 3 MB): those cannot
    ride inline, so they take the express lane (its posts count them) and reduce out of
    it. Between 3 MB calls the background thread unparks and takes the peer's request:
    the express call waits for it and still runs the pair itself."""
    count = 16
    outs = run_local(jobs.express_rounds, args=(count, None, 0.0, limit), num_proc=2,
                     env=ENV)
    _check_results(outs, count)
    large = sum(1 for i in range(count) if jobs.case_spec(i, limit)["n"] > 256)
    for r, out in enumerate(outs):
        assert out["express"] >= count - 2, f"rank {r}: {out}"
        assert out["lane_posts"] >= large, f"rank {r}: {out}"


@pytest.mark.parametrize("limit", [LANE_LIMIT, LARGER], ids=["1MB", "3MB"])
def test_a_slow_peer_at_the_lane_size_hands_over_and_frees_the_buffers(limit):
    """Rank 1 comes late to every call: rank 0's tensors wait in the lane while its usual
    cycle takes over; rank 1 copies them out (freeing the buffers) and every result is
    exact, so the lane's two buffers never carry a tensor over one not yet read."""
    count = 8
    # Late by five times the express wait (a drive slice, 50 ms): a loaded host's
    # scheduling delay cannot make rank 1 come in time (at 60 ms, 10 ms of it could).
    outs = run_local(jobs.express_rounds, args=(count, 1, 5 * DRIVE_SLICE_S, limit),
                     num_proc=2, env=ENV)
    _check_results(outs, count)
    assert outs[0]["fallbacks"] >= count - 2, outs[0]
    assert outs[0]["lane_posts"] >= 2, outs[0]


def test_express_lane_off_keeps_large_allreduces_on_the_ring():
    count = 8
    outs = run_local(jobs.express_rounds, args=(count, None, 0.0, LANE_LIMIT), num_proc=2,
                     env={**ENV, "HVD_SPARK_EXPRESS_LANE_BYTES": "0"})
    _check_results(outs, count)
    assert [out["lane_posts"] for out in outs] == [0, 0]


@pytest.mark.parametrize("n", [3, 100_000], ids=["inline", "lane"])
def test_ranks_that_disagree_on_the_express_path_both_fail_alike_and_promptly(n):
    outs = run_local(jobs.disagreeing_shapes, args=(n,), num_proc=2, env=ENV)
    texts = [out["error"] for out in outs]
    assert texts[0] is not None and texts[0] == texts[1], texts
    assert "bad" in texts[0] and "shape" in texts[0], texts[0]
    for out in outs:
        assert out["seconds"] < 5.0, out
        assert out["again"] == [3.0, 3.0, 3.0]
        assert out["fallbacks"] >= 1


def test_a_loop_of_express_calls_still_times_out_a_request_rank_0_never_makes():
    """Rank 0's express calls skip its cycle; the coordinator's timeout must still fail
    the allgather only rank 1 submitted, with the usual message, within the timeout."""
    outs = run_local(jobs.express_loop_with_a_stalled_request, args=(400_000,), num_proc=2,
                     env={"HVD_SPARK_TIMEOUT": "2"})
    rank1 = outs[1]
    assert rank1["error"] is not None and "did not submit" in rank1["error"], rank1
    assert rank1["failed_after"] is not None and rank1["failed_after"] < 6.0, rank1
    assert outs[0]["express"] > 0, outs[0]  # the loop did run on the express path
