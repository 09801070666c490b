"""One contract every collectives engine must pass (TCP, MPI, and NCCL where a GPU is).

A subclass provides ``run_job(name)``: it runs ``engine_jobs.JOBS[name]`` on two real
ranks of its engine and returns each rank's outcome, ``("ok", result)`` or
``("err", exception type name, message)``. The contract checks the results: every
operation completes with the right values, ranks may submit in different orders, a
stalled operation meets the stall policy, a failing rank becomes an error on the other
that names it, and a shutdown leaves no engine thread behind.
"""

from __future__ import annotations

import numpy as np

SIZE = 2


def results(outcomes: list[tuple]) -> list:
    """Each rank's result; fails the test with the errors when a rank raised."""
    errors = [o for o in outcomes if o[0] != "ok"]
    assert not errors, errors
    return [o[1] for o in outcomes]


class EngineContract:
    """Mixin of contract tests; subclasses define ``run_job``."""

    def run_job(self, name: str) -> list[tuple]:
        raise NotImplementedError

    def test_every_op_completes_with_the_right_results(self):
        for rank, out in enumerate(results(self.run_job("every_op"))):
            np.testing.assert_array_equal(out["allreduce_small"], np.full(4, 3, np.float32))
            np.testing.assert_allclose(out["allreduce_big"],
                                       np.arange(100_000, dtype=np.float32) * 3)
            np.testing.assert_array_equal(
                out["allgather"], np.concatenate([np.full((r + 1, 3), r, np.int32)
                                                  for r in range(SIZE)]))
            np.testing.assert_array_equal(out["broadcast"], np.arange(5, dtype=np.float64) * 2)
            received, splits = out["alltoall"]
            want = np.concatenate([np.arange(2 * rank, 2 * rank + 2) + 100 * r
                                   for r in range(SIZE)])
            np.testing.assert_array_equal(received, want)
            assert list(splits) == [2] * SIZE
            np.testing.assert_array_equal(out["reducescatter"], np.full((2, 3), 3, np.float32))

    def test_ranks_may_submit_in_different_orders(self):
        for out in results(self.run_job("out_of_order")):
            np.testing.assert_allclose(out["ooo-big"], np.arange(50_000, dtype=np.float32) * 2)
            np.testing.assert_array_equal(out["ooo-small"], np.arange(8, dtype=np.float32) * 2)
            np.testing.assert_array_equal(out["ooo-bcast"], np.zeros(6))

    def test_a_stalled_operation_is_warned_about_then_failed(self):
        first, second = results(self.run_job("stalled"))
        for name in ("lonely-small", "lonely-bcast"):
            assert first[name] is not None, f"{name} completed without rank 1"
            assert "ranks [1] did not submit it within" in first[name][1], first[name]
            assert any(f"{name!r} has waited over" in w and "[1]" in w
                       for w in first["warnings"]), first["warnings"]
        for out in (first, second):  # the engine goes on working
            np.testing.assert_array_equal(out["after"], np.full(3, 2, np.float32))

    def test_a_failing_rank_is_an_error_naming_it_on_the_other(self):
        zero, one = self.run_job("failing_rank")
        assert one == ("ok", "aborted"), one
        assert zero[0] == "ok" and zero[1] is not None, zero
        kind, message, waited = zero[1]
        assert "rank 1" in message, (kind, message)
        assert waited < 15, f"rank 0 waited {waited:.1f} s (the timeout, not the failure)"

    def test_shutdown_leaves_no_engine_thread(self):
        assert results(self.run_job("shutdown_leaves_no_thread")) == [[], []]
