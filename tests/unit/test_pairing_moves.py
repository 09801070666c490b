"""The arithmetic of a paired broadcast or allgather (``pairing``): which requests two
ranks may decide alone, what they carry and the result they build. Pure logic; the
ranks' exchange runs in tests/integration/test_express_moves.py."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_spark.collectives import messages as m
from hvd_spark.collectives.pairing import (
    disagreement,
    moved_output,
    pair_output,
    pair_payload,
    pairable,
)
from hvd_spark.errors import CollectiveError


def _request(kind: str, shape: tuple, payload, root: int = -1, members=None) -> m.Request:
    return m.Request("x", kind, "float32", shape, root=root, members=members,
                     payload=payload)


def test_moves_are_pairable_only_with_a_payload_and_in_the_global_set():
    data = np.zeros(3, np.float32)
    assert pairable(_request(m.BROADCAST, (3,), data, root=0))
    assert pairable(_request(m.BROADCAST, (3,), data[:0], root=0))  # the receiver's
    assert pairable(_request(m.ALLGATHER, (3,), data))
    assert not pairable(_request(m.BROADCAST, (3,), None, root=0))
    assert not pairable(_request(m.ALLGATHER, (3,), data, members=(0, 1)))
    assert not pairable(_request(m.ALLTOALL, (3,), data))


def test_a_broadcast_receiver_sends_none_of_its_tensor():
    work = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert pair_payload(m.BROADCAST, work, root=1, rank=0).size == 0
    assert pair_payload(m.BROADCAST, work, root=1, rank=1).tolist() == list(range(6))
    assert pair_payload(m.ALLGATHER, work, root=-1, rank=0).shape == (6,)


@pytest.mark.parametrize("root", [0, 1])
def test_a_paired_broadcast_writes_the_roots_tensor_into_the_target(root):
    tensors = [np.full(4, 10.0 * r, np.float32) for r in (0, 1)]
    requests = [_request(m.BROADCAST, (4,), pair_payload(m.BROADCAST, t, root, r), root)
                for r, t in enumerate(tensors)]
    assert disagreement("x", *requests) is None
    for rank in (0, 1):
        target = tensors[rank].copy()
        out = pair_output(*requests, target)
        assert out is target and out.tolist() == [10.0 * root] * 4


def test_a_paired_allgather_concatenates_in_rank_order_whatever_rank_builds_it():
    first = np.arange(2 * 3, dtype=np.float32).reshape(2, 3)
    second = -np.arange(1 * 3, dtype=np.float32).reshape(1, 3)
    requests = [_request(m.ALLGATHER, t.shape, t.reshape(-1)) for t in (first, second)]
    assert disagreement("x", *requests) is None  # first dims may differ
    want = np.concatenate([first, second])
    for target in (first, second):
        out = pair_output(*requests, target)
        assert out.shape == (3, 3) and (out == want).all()


def test_payloads_that_are_not_their_tensors_raise_instead_of_inventing_bits():
    target = np.zeros(4, np.float32)
    with pytest.raises(CollectiveError, match="HVD_SPARK_EAGER_BYTES"):
        moved_output(m.BROADCAST, 0, target[:0], target, (4,), (4,), target)
    with pytest.raises(CollectiveError, match="allgather"):
        moved_output(m.ALLGATHER, -1, target[:2], target, (1, 4), (1, 4), target.reshape(1, 4))


def test_disagreeing_roots_become_an_error_response():
    data = np.zeros(3, np.float32)
    response = disagreement("x", _request(m.BROADCAST, (3,), data, root=0),
                            _request(m.BROADCAST, (3,), data, root=1))
    assert response is not None and "root_rank" in response.error
