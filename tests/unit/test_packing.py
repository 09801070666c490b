"""Which tensors of a grouped allreduce travel packed, and the layout the ranks compare."""

from __future__ import annotations

import numpy as np

from hvd_spark.collectives import packing
from hvd_spark.collectives.operations import Handle
from hvd_spark.collectives.ops import ReduceOp
from hvd_spark.errors import CollectiveError


def test_plan_packs_small_tensors_of_the_most_common_dtype():
    group = [np.ones(3, np.float32), np.ones(4, np.float64), np.ones(5, np.float64),
             np.ones(20000, np.float64),  # 160 KB: alone
             np.ones(2, np.float32), np.ones(6, np.float64)]
    assert packing.plan(group, ReduceOp.Sum, inplace=False) == [1, 2, 5]
    # A tie goes to the dtype seen first.
    assert packing.plan(group[:2], ReduceOp.Sum, inplace=False) == [0]
    assert packing.plan([np.ones(20000)], ReduceOp.Sum, inplace=False) == []
    assert packing.plan(group, ReduceOp.Adasum, inplace=False) is None  # not element-wise


def test_plan_leaves_out_what_cannot_be_packed():
    frozen = np.ones(3, np.float32)
    frozen.flags.writeable = False
    group = [frozen, np.ones(3, np.float32), [1.0, 2.0], np.ones(2, object), 2.5]
    assert packing.plan(group, ReduceOp.Sum, inplace=True) == [1]  # read-only: alone, fails
    assert packing.plan(group, ReduceOp.Sum, inplace=False) == [0, 1]


def test_layout_tells_groups_apart_and_reads_in_errors():
    a = packing.layout_of([np.ones((2, 3), np.float32), np.ones(5, np.float16), 1.5])
    assert a == packing.layout_of([np.zeros((2, 3), np.float32), np.ones(5, np.float16), 2.0])
    assert a != packing.layout_of([np.ones((3, 2), np.float32), np.ones(5, np.float16), 1.5])
    assert a != packing.layout_of([np.ones((2, 3), np.float64), np.ones(5, np.float16), 1.5])
    assert packing.describe(a) == "3 tensors: float32[2, 3], float16[5], float64[]"
    # Which tensors a rank packs is part of it: equal sizes packed differently must differ.
    two = [np.ones(1, np.float32), np.float32(2.0)]
    assert packing.layout_of(two, [0]) != packing.layout_of(two, [1])
    assert packing.describe(packing.layout_of(two, [0])) == (
        "2 tensors: float32[1], float32[]; packed: [0]")
    many = packing.layout_of([np.ones(1)] * 9)
    assert packing.describe(many).endswith(", ...") and packing.describe(many).startswith("9 ")


def test_packed_handles_slice_the_packed_result_and_report_a_failure_once():
    arrays = [np.ones(3, np.float32), np.ones((2, 2), np.float32)]
    reported = []
    handle = Handle("g.packed")
    pack = packing.Pack(handle, arrays, [0, 1], inplace=True,
                        report=lambda names, exc: reported.append(names) or [],
                        names=["g.0", "g.1"], settle=lambda h, seconds: None)
    parts = [packing.PartHandle(f"g.{i}", pack, i) for i in range(2)]
    assert not parts[0].done()
    result = np.arange(7, dtype=np.float32)
    packing.scatter(result, arrays, [0, 1])  # the packed request's finish, as it completes
    assert arrays[0].tolist() == [0, 1, 2]  # written back before anyone waits
    handle.set_result(result)
    assert parts[1].wait(1.0) is arrays[1] and arrays[1].tolist() == [[3, 4], [5, 6]]
    assert parts[0].wait(1.0).tolist() == [0, 1, 2]

    failing = Handle("h.packed")
    pack = packing.Pack(failing, arrays, [1], inplace=False,
                        report=lambda names, exc: reported.append(names) or [],
                        names=["h.0", "h.1"], settle=lambda h, seconds: None)
    alone = Handle("h.0")
    guarded = packing.GuardedHandle(alone, pack)
    failing.set_error(CollectiveError("groups differ"))
    assert guarded.done()  # the packed error ends the wait, not the partner's timeout
    for h in (guarded, packing.PartHandle("h.1", pack, 1)):
        try:
            h.wait(1.0)
        except CollectiveError as exc:
            assert "groups differ" in str(exc)
        else:
            raise AssertionError("the packed request's error must come first")
    assert reported == [["h.1"]]


def test_a_timed_out_wait_names_the_whole_wait_not_what_was_left_of_it():
    from hvd_spark.errors import CollectiveTimeoutError

    handle = Handle("slow")
    pack = packing.Pack(handle, [np.ones(2, np.float32)], [0], inplace=False,
                        report=lambda names, exc: [], names=["g.0"],
                        settle=lambda h, seconds: None)
    for h in (handle, packing.PartHandle("g.0", pack, 0)):
        try:
            h.wait(0.0, waited=42.0)  # the engine's deadline passed while it drove
        except CollectiveTimeoutError as exc:
            assert "within 42.0 s" in str(exc), exc
        else:
            raise AssertionError("an unfinished handle returned")
