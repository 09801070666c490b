"""Grouped allreduces pack their small tensors (real processes, real sockets)."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_spark.collectives import ops
from hvd_spark.runner import run_local
from tests.integration import packing_jobs as jobs

ENV = {"HVD_SPARK_TIMEOUT": "60"}


def _reference(inputs: list[list[np.ndarray]], op: int, pre: float, post: float) -> list:
    """Each tensor reduced alone from every rank's input, in rank order, with the
    engine's arithmetic (integers scale and divide truncating)."""
    out = []
    for per_rank in zip(*inputs):
        rows = [np.array(a, copy=True) for a in per_rank]
        for row in rows:
            ops.scale_in_place(row, pre)
        total = rows[0]
        for row in rows[1:]:
            ops.reduce_into(total, row, ops.ReduceOp(op))
        ops.finish_reduction(total, ops.ReduceOp(op), post, len(rows))
        out.append(total.astype(np.float64))
    return out


@pytest.mark.parametrize("num_proc", [2, 3])
def test_grouped_allreduce_packs_small_tensors_with_the_right_results(num_proc):
    steps = 2
    results = run_local(jobs.grouped_results, args=(steps,), num_proc=num_proc, env=ENV)
    assert all(r["agree"] for r in results)
    first = results[0]
    for k, run in enumerate(first["runs"]):
        step = k // 4
        inputs = [jobs._group(step, r) for r in range(num_proc)]
        want = _reference(inputs, run["op"], run["pre"], run["post"])
        for res in results:
            got = res["runs"][k]
            assert got["untouched"], "a grouped allreduce changed its inputs"
            for i, (w, a, b) in enumerate(zip(want, got["got"], got["inplace"])):
                assert a.shape == inputs[0][i].shape and a.dtype == inputs[0][i].dtype, i
                tol = 2e-2 if a.dtype == np.float16 else 1e-5
                np.testing.assert_allclose(a.astype(np.float64), w, rtol=tol, atol=tol,
                                           err_msg=f"run {k} tensor {i}")
                assert a.tobytes() == b.tobytes(), f"in place differs, run {k} tensor {i}"
        # The 14 small float32 tensors travel as one, and the two large float32 ones ride
        # on it uncopied (not with a prescale: they go alone, scaled in copies): 18
        # tensors, 3 operations (5).
        want_ran = 3 if run["pre"] == 1.0 else 5
        assert first["runs"][k]["ran"] == want_ran, (k, first["runs"][k]["ran"])


def test_groups_that_differ_between_ranks_fail_at_once_on_every_rank():
    results = run_local(jobs.mismatched_groups, num_proc=2, env=ENV)
    for res in results:
        for i, (error, seconds) in enumerate(zip(res["errors"], res["seconds"])):
            assert error is not None, f"case {i}: no error"
            assert "different groups of tensors" in error and "rank 1:" in error, error
            assert seconds < 10, f"case {i} took {seconds:.1f} s"  # not the 60 s timeout
        assert res["after"] == [[2.0] * 2, [2.0] * 3, [2.0] * 3, [2.0] * 2, [2.0] * 2]



def test_inplace_group_is_written_back_when_its_handles_are_done():
    for res in run_local(jobs.inplace_done_before_wait, num_proc=2, env=ENV):
        assert res["same"]
        want = [np.full(4, 3.0), np.full((2, 3), 30.0), np.full(50000, 3.0)]
        for got, w in zip(res["seen"], want):
            np.testing.assert_array_equal(got, w)


def test_a_refused_reduction_of_the_packed_tensors_names_a_tensor_of_the_group():
    for res in run_local(jobs.refused_packed_reduction, num_proc=2, env=ENV):
        error = res["error"]
        assert error is not None and "Average is undefined" in error, error
        assert "'flags.1'" in error and ".packed" not in error, error
        assert res["seconds"] < 10, res["seconds"]
        assert res["after"] == [[True, True], [False]]
        assert res["large"] == [100000.0, 100000.0]


def test_large_tensors_ride_on_the_packed_request_in_place_and_out():
    results = run_local(jobs.uncopied_large_tensors, num_proc=2, env=ENV)
    strided = (np.arange(120000, dtype=np.float32).reshape(400, 300) * 3)[:, ::2]
    for res in results:
        small, big, read_only, f64 = res["got"]
        np.testing.assert_array_equal(small, np.full(10, 3.0, np.float32))
        assert big.shape == (400, 150) and big.dtype == np.float32
        np.testing.assert_array_equal(big, strided)
        np.testing.assert_array_equal(read_only, np.full(30000, 3.0, np.float32))
        assert f64.dtype == np.float64
        np.testing.assert_array_equal(f64, np.full(20000, 3.0))
        # The float32 ones on one request; the float64 one alone.
        assert res["ran"] == 2, res["ran"]
        assert res["inputs_kept"]
        assert res["same"]
        want_in = [np.full(10, 1.5, np.float32), strided / 2, np.full((300, 100), 1.5)]
        for got, want in zip(res["in_place"], want_in):
            np.testing.assert_array_equal(got, want.astype(np.float32))
        error = res["read_only_error"]
        assert error is not None and "read-only" in error and "ro.1" in error, error
        assert res["read_only_seconds"] < 10, res["read_only_seconds"]
        assert res["subclass"] == [4.0, 150000.0]
        error = res["kinds_error"]
        assert error is not None and "not the same kinds of values" in error, error
        assert res["kinds_seconds"] < 10, res["kinds_seconds"]
        assert res["last_joined"] in (0, 1)
    assert results[0]["alone"] == [[2.0, 2.0, 2.0, 6.0], [5.0, 5.0, 5.0, 250000.0]]
