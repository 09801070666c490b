"""The express lane's buffers (``collectives.tcp.express_lane``) between two real mappings.

Both ends negotiate over a socket pair on two threads, as two ranks do over their data
socket; the two-rank jobs in tests/integration/test_express_pairs.py run it inside the
engine.
"""

from __future__ import annotations

import glob
import os
import socket

import numpy as np
import pytest

from hvd_spark.collectives.tcp import express_lane
from hvd_spark.collectives.tcp.express_lane import ExpressLane, negotiate_lane
from hvd_spark.errors import CollectiveError
from tests.threads import run_on_threads

_TAG = "lanetest"


def _lanes(capacities: tuple[int, int] = (1 << 16, 1 << 16)) -> list[ExpressLane | None]:
    a, b = socket.socketpair()
    try:
        return run_on_threads(
            [(a, 1, capacities[0]), (b, 0, capacities[1])],
            lambda item: negotiate_lane(item[0], item[1], item[2], tag=_TAG), timeout=30)
    finally:
        a.close()
        b.close()


def _close(lanes: list[ExpressLane | None]) -> None:
    for lane in lanes:
        if lane is not None:
            lane.close()


def test_a_tensor_posted_on_one_end_is_read_in_place_on_the_other():
    lanes = _lanes()
    try:
        sender, receiver = lanes
        data = np.arange(1000, dtype=np.float32)
        seq = sender.post(data)
        view = receiver.view(seq, "float32", data.size)
        np.testing.assert_array_equal(view, data)
        receiver.release(seq)
        assert sender.posted == 1
        # Nothing of the job is left in /dev/shm: the files went once both had mapped.
        assert not glob.glob(os.path.join("/dev/shm", f"hvd_spark_{_TAG}_*"))
    finally:
        _close(lanes)


def test_a_buffer_is_not_written_again_before_the_peer_released_it():
    lanes = _lanes()
    try:
        sender, receiver = lanes
        first, second = np.full(10, 1.0), np.full(10, 2.0)
        s1, s2 = sender.post(first), sender.post(second)
        # Both buffers hold unread tensors: a third must wait (the sender goes inline).
        assert not sender.can_post(80)
        v1 = receiver.view(s1, "float64", 10)
        receiver.release(s1)
        assert sender.can_post(80)  # the first buffer is free again, the second is not
        s3 = sender.post(np.full(10, 3.0))
        assert not sender.can_post(80)
        v2 = receiver.view(s2, "float64", 10)
        np.testing.assert_array_equal(v2, second)  # untouched by the third post
        np.testing.assert_array_equal(v1, np.full(10, 3.0))  # the third reused buffer 0
        receiver.release(s2)
        np.testing.assert_array_equal(receiver.view(s3, "float64", 10), np.full(10, 3.0))
    finally:
        _close(lanes)


def test_a_tensor_larger_than_the_buffers_does_not_fit():
    lanes = _lanes()
    try:
        assert lanes[0].can_post(1 << 16)
        assert not lanes[0].can_post((1 << 16) + 1)
    finally:
        _close(lanes)


def test_a_tensor_named_out_of_order_is_a_protocol_error():
    lanes = _lanes()
    try:
        sender, receiver = lanes
        sender.post(np.zeros(4))
        sender.post(np.zeros(4))
        with pytest.raises(CollectiveError, match="out of order: tensor 1 arrived where 0"):
            receiver.view(1, "float64", 4)
    finally:
        _close(lanes)


def test_each_end_sends_through_buffers_of_its_own_size():
    """The ranks' settings may differ: each reads the other's buffers at the other's size."""
    lanes = _lanes((1 << 12, 1 << 16))
    try:
        small, large = lanes
        assert (small.capacity, large.capacity) == (1 << 12, 1 << 16)
        data = np.arange(1 << 13, dtype=np.float32)  # 32 KB: only the large end sends it
        assert not small.can_post(data.nbytes)
        large.post(np.zeros(1, np.float32))
        seq = large.post(data)
        small.view(0, "float32", 1)
        np.testing.assert_array_equal(small.view(seq, "float32", data.size), data)
    finally:
        _close(lanes)


def test_a_rank_with_the_lane_off_leaves_both_without_one():
    assert _lanes((0, 1 << 16)) == [None, None]
    assert _lanes((1 << 16, 0)) == [None, None]
    assert not glob.glob(os.path.join("/dev/shm", f"hvd_spark_{_TAG}_*"))


def test_the_lane_is_made_only_where_stores_keep_their_order(monkeypatch):
    monkeypatch.setattr(express_lane.platform, "machine", lambda: "aarch64")
    assert not express_lane.lane_supported()
    monkeypatch.setattr(express_lane.platform, "machine", lambda: "x86_64")
    assert express_lane.lane_supported()
