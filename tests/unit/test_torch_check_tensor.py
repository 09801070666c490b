"""The torch binding's check of a tensor before it is sent: what passes, and the hint a
refused tensor gets (``check_tensor`` and its fast test ``sendable`` must agree)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hvd_spark.errors import ConfigError
from hvd_spark.torch import tensor_ops as T


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_per_tensor is deprecated, still made
        return torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8)


REFUSED = [
    ("a list", lambda: [1.0], "torch.as_tensor"),
    ("sparse", lambda: torch.zeros(2).to_sparse(), "to_dense"),
    ("complex64", lambda: torch.zeros(2, dtype=torch.complex64), "view_as_real"),
    ("complex32", lambda: torch.zeros(2, dtype=torch.complex32), "view_as_real"),
    ("float8", lambda: torch.zeros(2).to(torch.float8_e4m3fn), "cast it first"),
    ("quantized", _quantized, "dequantize"),
    ("meta", lambda: torch.zeros(2, device="meta"), "materialize"),
    ("lazily negated", lambda: torch.zeros(2)._neg_view(), "resolve_neg"),
]


@pytest.mark.parametrize(("what", "make", "hint"), REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_tensors_name_the_call_and_the_fix(what, make, hint):
    tensor = make()
    assert not T.sendable(tensor)
    with pytest.raises(ConfigError) as err:
        T.check_tensor(tensor, "allreduce", "grad.fc1")
    assert "allreduce 'grad.fc1'" in str(err.value)
    assert hint in str(err.value), (what, str(err.value))


@pytest.mark.parametrize("dtype", sorted(T._SUPPORTED, key=str))
def test_supported_dtypes_pass(dtype):
    tensor = torch.zeros(3, dtype=dtype)
    assert T.sendable(tensor)
    assert T.check_tensor(tensor, "allreduce", None) is tensor


def test_strided_views_pass():
    base = torch.arange(12.0).reshape(3, 4)
    for view in (base.t(), base[:, 1], base[::2]):
        assert T.check_tensor(view, "allreduce", "v") is view
