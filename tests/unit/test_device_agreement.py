"""Ranks must agree whether a tensor is on the GPU: the coordinator says so, never a hang."""

from __future__ import annotations

import numpy as np

from hvd_spark.collectives import messages as m
from hvd_spark.collectives.coordinator import Coordinator, validate
from hvd_spark.collectives.nccl import arrays


def _req(name: str, device: str = "cpu", shape=(4,)) -> m.Request:
    return m.Request(name, m.ALLREDUCE, "float32", shape, device=device)


def test_cpu_on_one_rank_and_cuda_on_another_is_an_error_naming_both():
    response = validate("grad", {0: _req("grad", "cuda"), 1: _req("grad", "cpu")}, 2)
    assert response.error is not None
    assert "device (CPU or GPU)" in response.error
    assert "rank 0: cuda" in response.error and "rank 1: cpu" in response.error


def test_cpu_and_cuda_tensors_never_fuse_into_one_buffer():
    coord = Coordinator(2, 1 << 20)
    for rank in (0, 1):
        coord.add(rank, _req("a", "cpu"), 0.0)
        coord.add(rank, _req("b", "cuda"), 0.0)
        coord.add(rank, _req("c", "cuda"), 0.0)
    responses = coord.take_responses()
    assert [r.names for r in responses] == [("a",), ("b", "c")]


def test_host_arrays_are_not_device_arrays():
    a = np.ones(3)
    assert not arrays.is_device(a) and arrays.device_of(a) == "cpu"
    z = arrays.zeros((2, 3), np.float32, "cpu")
    assert isinstance(z, np.ndarray) and z.shape == (2, 3) and not z.any()
    out = np.zeros(3)
    arrays.copy_into(out, a)
    assert out.tolist() == [1.0, 1.0, 1.0]
