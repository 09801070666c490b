"""The coordinator's negotiation logic: agreement checks, fusion, stalls, departures."""

from __future__ import annotations

import numpy as np

from hvd_spark.collectives import messages as m
from hvd_spark.collectives.coordinator import Coordinator
from hvd_spark.collectives.ops import ReduceOp


def _req(name, shape=(4,), dtype="float32", kind=m.ALLREDUCE, **kw):
    return m.Request(name, kind, dtype, shape, **kw)


def test_response_only_when_every_rank_asked():
    c = Coordinator(3, 1 << 20)
    c.add(0, _req("a"), 0.0)
    c.add(2, _req("a"), 0.0)
    assert not c.has_ready()
    c.add(1, _req("a"), 0.0)
    (resp,) = c.take_responses()
    assert resp.names == ("a",) and resp.error is None


def test_names_match_regardless_of_order():
    c = Coordinator(2, 1 << 20)
    c.add(0, _req("a"), 0)
    c.add(1, _req("b"), 0)
    c.add(0, _req("b"), 0)
    c.add(1, _req("a"), 0)
    names = [n for r in c.take_responses() for n in r.names]
    assert sorted(names) == ["a", "b"]


def test_shape_mismatch_names_tensor_and_ranks():
    c = Coordinator(2, 1 << 20)
    c.add(0, _req("w", shape=(2, 3)), 0)
    c.add(1, _req("w", shape=(3, 2)), 0)
    (resp,) = c.take_responses()
    assert "'w'" in resp.error and "rank 0: (2, 3)" in resp.error and "rank 1: (3, 2)" in resp.error


def test_dtype_and_op_mismatch():
    c = Coordinator(2, 1 << 20)
    c.add(0, _req("d", dtype="float32"), 0)
    c.add(1, _req("d", dtype="float64"), 0)
    c.add(0, _req("o", op=int(ReduceOp.Sum)), 0)
    c.add(1, _req("o", op=int(ReduceOp.Max)), 0)
    errors = {r.names[0]: r.error for r in c.take_responses()}
    assert "dtype" in errors["d"] and "reduce op" in errors["o"]


def test_fusion_groups_by_dtype_up_to_threshold():
    c = Coordinator(1, fusion_threshold=40)
    for i in range(5):
        c.add(0, _req(f"f{i}", shape=(4,)), 0)  # 16 bytes each
    c.add(0, _req("g", dtype="float64"), 0)
    responses = c.take_responses()
    groups = [r.names for r in responses]
    assert groups == [("f0", "f1"), ("f2", "f3"), ("f4",), ("g",)]


def test_allgather_and_alltoall_responses():
    c = Coordinator(2, 0)
    c.add(0, _req("g", shape=(1, 3), kind=m.ALLGATHER), 0)
    c.add(1, _req("g", shape=(4, 3), kind=m.ALLGATHER), 0)
    c.add(0, _req("t", shape=(3,), kind=m.ALLTOALL, splits=(1, 2)), 0)
    c.add(1, _req("t", shape=(2,), kind=m.ALLTOALL), 0)
    by_name = {r.names[0]: r for r in c.take_responses()}
    assert by_name["g"].first_dims == (1, 4)
    assert by_name["t"].splits == ((1, 2), (1, 1))


def test_alltoall_bad_splits_is_an_error():
    c = Coordinator(2, 0)
    c.add(0, _req("t", shape=(3,), kind=m.ALLTOALL), 0)
    c.add(1, _req("t", shape=(2,), kind=m.ALLTOALL, splits=(5, 1)), 0)
    (resp,) = c.take_responses()
    assert "rank 0 has 3 rows" in resp.error


def test_stall_reported_once_and_expiry_fails():
    c = Coordinator(3, 0)
    c.add(0, _req("s"), 0.0)
    assert c.stalled(30.0, 60.0) == []
    assert c.stalled(61.0, 60.0) == [("s", [1, 2])]
    assert c.stalled(62.0, 60.0) == []
    c.expire(700.0, 600.0)
    (resp,) = c.take_responses()
    assert "ranks [1, 2] did not submit" in resp.error


def test_departed_rank_fails_waiting_and_new_ops():
    c = Coordinator(2, 0)
    c.add(0, _req("x"), 0)
    c.depart(1, "called shutdown()")
    (resp,) = c.take_responses()
    assert "rank 1 called shutdown()" in resp.error
    c.add(0, _req("y"), 0)
    (resp,) = c.take_responses()
    assert resp.error and "'y'" in resp.error


def test_bool_average_rejected():
    c = Coordinator(1, 0)
    c.add(0, _req("b", dtype="bool", op=int(ReduceOp.Average)), 0)
    (resp,) = c.take_responses()
    assert "bool" in resp.error


def _eager_req(name, values, **kw):
    import numpy as np

    arr = np.asarray(values, np.float32)
    return m.Request(name, m.ALLREDUCE, "float32", arr.shape, payload=arr, **kw)


def test_small_tensors_with_payloads_fuse_into_one_reduced_response():
    import numpy as np

    c = Coordinator(2, 1 << 20, eager_bytes=64)
    for rank in (1, 0):  # arrival order does not change the result's rank order
        c.add(rank, _eager_req("a", [1.0 + rank, 2.0], op=int(ReduceOp.Sum)), 0.0)
        c.add(rank, _eager_req("b", [10.0 * (rank + 1)], op=int(ReduceOp.Sum)), 0.0)
    (resp,) = c.take_responses()
    assert resp.names == ("a", "b") and resp.error is None
    np.testing.assert_array_equal(resp.data, [3.0, 4.0, 30.0])


def test_average_and_postscale_apply_to_the_eager_result():
    import numpy as np

    c = Coordinator(2, 1 << 20, eager_bytes=64)
    for rank in (0, 1):
        c.add(rank, _eager_req("a", [2.0 * (rank + 1)], op=int(ReduceOp.Average),
                               postscale=10.0), 0.0)
    (resp,) = c.take_responses()
    np.testing.assert_array_equal(resp.data, [30.0])


def test_no_eager_result_above_the_limit_without_payloads_or_with_adasum():
    c = Coordinator(2, 1 << 20, eager_bytes=8)
    for rank in (0, 1):  # 12 bytes > 8
        c.add(rank, _eager_req("big", [1.0, 2.0, 3.0], op=int(ReduceOp.Sum)), 0.0)
    assert c.take_responses()[0].data is None
    c = Coordinator(2, 1 << 20, eager_bytes=64)
    c.add(0, _eager_req("mixed", [1.0], op=int(ReduceOp.Sum)), 0.0)
    c.add(1, _req("mixed", shape=(1,), op=int(ReduceOp.Sum)), 0.0)  # no payload
    (resp,) = c.take_responses()
    assert resp.error is None and resp.data is None
    c.add(0, _eager_req("ada", [1.0], op=int(ReduceOp.Adasum)), 0.0)
    c.add(1, _eager_req("ada", [1.0], op=int(ReduceOp.Adasum)), 0.0)
    assert c.take_responses()[0].data is None


def test_eager_off_by_default():
    c = Coordinator(2, 1 << 20)
    for rank in (0, 1):
        c.add(rank, _eager_req("a", [1.0], op=int(ReduceOp.Sum)), 0.0)
    assert c.take_responses()[0].data is None


def test_a_lone_eager_result_is_reduced_in_rank_order_into_its_own_array():
    """One tensor, three ranks arriving out of order: rank order, and no payload aliased."""
    import numpy as np

    c = Coordinator(3, 1 << 20, eager_bytes=64)
    payloads = {r: np.array([0.1 * (r + 1), 1e8, -1e8], np.float32) for r in range(3)}
    for rank in (2, 0, 1):
        c.add(rank, m.Request("x", m.ALLREDUCE, "float32", (3,), int(ReduceOp.Average),
                              payload=payloads[rank]), 0.0)
    (resp,) = c.take_responses()
    expected = payloads[0].copy()
    expected += payloads[1]
    expected += payloads[2]
    expected *= np.float32(1 / 3)
    np.testing.assert_array_equal(resp.data, expected)
    assert not any(np.shares_memory(resp.data, p) for p in payloads.values())
    assert payloads[0][0] == np.float32(0.1)  # rank 0's (the caller's) input untouched


def test_a_lone_eager_request_with_a_payload_of_the_wrong_size_runs_on_the_backend():
    import numpy as np

    c = Coordinator(2, 1 << 20, eager_bytes=64)
    c.add(0, m.Request("x", m.ALLREDUCE, "float32", (2,), payload=np.ones(2, np.float32)), 0.0)
    c.add(1, m.Request("x", m.ALLREDUCE, "float32", (2,), payload=np.ones(3, np.float32)), 0.0)
    (resp,) = c.take_responses()
    assert resp.error is None and resp.data is None


def test_fusion_keeps_submission_order_and_starts_a_new_group_past_the_threshold():
    c = Coordinator(2, fusion_threshold=40)
    for rank in (0, 1):
        for name in ("a", "b", "c", "d"):  # 16 bytes each: two fit under 40
            c.add(rank, _req(name), 0.0)
        c.add(rank, _req("i", dtype="int32"), 0.0)
    responses = c.take_responses()
    assert [r.names for r in responses] == [("a", "b"), ("c", "d"), ("i",)]
    assert c.taken_bytes == 5 * 16


def test_only_a_lone_allreduce_rides_past_the_usual_eager_limit():
    """Fused eager tensors stay within ``eager_bytes`` (in the ring they cost less); one
    tensor alone (a synchronous call's) may ride up to ``lone_eager_bytes``."""
    c = Coordinator(2, 1 << 30, eager_bytes=1024, lone_eager_bytes=8192)
    rows = 200  # 800 bytes of float32 each: two fuse past 1024
    for r in range(2):
        for name in ("a", "b"):
            c.add(r, m.Request(name, "allreduce", "float32", (rows,),
                             payload=np.full(rows, r + 1, np.float32)), 0.0)
        c.add(r, m.Request("lone", "allreduce", "float64", (1000,),
                         payload=np.full(1000, r + 1.0)), 0.0)
    by_names = {resp.names: resp for resp in c.take_responses()}
    assert by_names[("a", "b")].data is None  # fused: the ring, not rank 0
    np.testing.assert_array_equal(by_names[("lone",)].data, np.full(1000, 3.0))
    assert Coordinator(2, 1 << 20, eager_bytes=64).lone_eager_bytes == 64
