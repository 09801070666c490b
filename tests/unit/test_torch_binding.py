"""hvd_spark.torch pieces that need no peers: validation, conversion, compression."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch  # CI installs it: a missing package is a failure, not a skip

import hvd_spark.torch as hvd  # noqa: E402
from hvd_spark.errors import ConfigError  # noqa: E402
from hvd_spark.torch import tensor_ops  # noqa: E402


def test_non_tensor_is_rejected_before_any_communication():
    with pytest.raises(ConfigError, match=r"allreduce 'g' expects a torch.Tensor, got list"):
        hvd.allreduce([1.0, 2.0], name="g")
    with pytest.raises(ConfigError, match="torch.Tensor"):
        hvd.allgather(np.ones(2))
    with pytest.raises(ConfigError, match="complex"):
        hvd.allreduce_(torch.ones(2, dtype=torch.complex64))


def test_duplicate_parameter_names_are_rejected():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    named = [("w", model.weight), ("w", model.bias)]
    with pytest.raises(ConfigError, match=r"duplicate names \['w'\]"):
        hvd.DistributedOptimizer(opt, named_parameters=named)
    with pytest.raises(ConfigError, match="missing from named_parameters"):
        hvd.DistributedOptimizer(opt, named_parameters=[("w", model.weight)])
    with pytest.raises(ConfigError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(opt, backward_passes_per_step=0)
    with pytest.raises(ConfigError, match="op=Average"):
        hvd.DistributedOptimizer(opt, op=hvd.Sum, gradient_predivide_factor=2.0)


def test_wrapped_optimizer_keeps_type_state_and_hyperparameters():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.3)
    dist = hvd.DistributedOptimizer(opt, model.named_parameters())
    assert isinstance(dist, torch.optim.Adam) and type(dist).__name__ == "Adam"
    assert dist.param_groups is opt.param_groups and dist.state is opt.state
    with pytest.raises(ConfigError, match="already"):
        hvd.DistributedOptimizer(dist)
    dist.remove_hooks()


def test_numpy_views_share_memory_including_bfloat16():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.bool):
        t = torch.zeros(4, dtype=dtype)
        arr = tensor_ops.as_numpy(t)
        arr[1] = 1
        assert t[1].item() == 1
        back = tensor_ops.from_numpy(arr, t.device)
        assert back.dtype == dtype and back.data_ptr() == t.data_ptr()


@pytest.mark.parametrize("comp,dtype", [(hvd.Compression.fp16, torch.float16),
                                        (hvd.Compression.bf16, torch.bfloat16)])
def test_compression_round_trip(comp, dtype):
    t = torch.tensor([1.5, -2.25, 3.0])
    wire, ctx = comp.compress(t)
    assert wire.dtype == dtype
    assert torch.equal(comp.decompress(wire, ctx), t)
    ints = torch.arange(3)
    assert comp.compress(ints)[0] is ints
    assert hvd.Compression.none.compress(t)[0] is t


def test_binding_imports_no_spark_or_tensorflow():
    code = ("import sys, hvd_spark.torch; "
            "bad = [m for m in ('pyspark', 'tensorflow', 'keras', 'hvd_spark.runner') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
