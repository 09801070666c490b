"""Tensor collectives, autograd, broadcasts and SyncBatchNorm on two real ranks."""

from __future__ import annotations

import pytest
import torch  # CI installs it: a missing package is a failure, not a skip

from hvd_spark.errors import WorkerFailedError  # noqa: E402
from hvd_spark.runner.local.local_launcher import run_local  # noqa: E402


def _collectives() -> None:
    import hvd_spark.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3) + r
    assert torch.equal(hvd.allreduce(t, name="avg"), torch.arange(6.0).reshape(2, 3) + 0.5)
    assert torch.equal(hvd.allreduce(t, op=hvd.Sum), 2 * torch.arange(6.0).reshape(2, 3) + 1)
    assert torch.equal(hvd.allreduce(t, op=hvd.Max), torch.arange(6.0).reshape(2, 3) + 1)
    assert torch.equal(hvd.allreduce(t, average=False), hvd.allreduce(t, op=hvd.Sum))
    # In place: same memory, no copy.
    ptr = t.data_ptr()
    out = hvd.allreduce_(t, op=hvd.Min)
    assert out is t and t.data_ptr() == ptr and torch.equal(t, torch.arange(6.0).reshape(2, 3))
    # Non-contiguous in place, bf16, fp16, int.
    nc = torch.ones(3, 4).t()
    hvd.allreduce_(nc, op=hvd.Sum)
    assert torch.equal(nc, torch.full((4, 3), 2.0))
    for dtype in (torch.bfloat16, torch.float16, torch.int64):
        x = torch.full((5,), r + 1, dtype=dtype)
        assert torch.equal(hvd.allreduce(x, op=hvd.Sum), torch.full((5,), 3, dtype=dtype))
        hvd.allreduce_(x, op=hvd.Sum)
        assert x.dtype == dtype and torch.equal(x, torch.full((5,), 3, dtype=dtype))
    h = hvd.allreduce_async(torch.ones(3), name="async")
    assert torch.equal(hvd.synchronize(h), torch.ones(3)) and hvd.poll(h)
    grouped = hvd.grouped_allreduce([torch.ones(2) * r, torch.ones(3)], op=hvd.Sum)
    assert torch.equal(grouped[0], torch.ones(2)) and torch.equal(grouped[1], 2 * torch.ones(3))
    gathered = hvd.allgather(torch.full((r + 1, 2), float(r)))
    assert torch.equal(gathered, torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
    b = torch.full((3,), float(r))
    assert torch.equal(hvd.broadcast(b, root_rank=1), torch.ones(3)) and b[0] == r
    hvd.broadcast_(b, root_rank=1)
    assert torch.equal(b, torch.ones(3))
    a2a, received = hvd.alltoall(torch.arange(3.0) + 10 * r, splits=[1, 2])
    assert received.tolist() == ([1, 1] if r == 0 else [2, 2])
    assert torch.equal(a2a, torch.tensor([0.0, 10.0]) if r == 0 else torch.tensor([1, 2, 11, 12.0]))
    rs = hvd.reducescatter(torch.ones(4, 2) * (r + 1), op=hvd.Sum)
    assert torch.equal(rs, torch.full((2, 2), 3.0))
    assert hvd.broadcast_object({"rank": r}, root_rank=1) == {"rank": 1}
    assert hvd.allgather_object(r * 10) == [0, 10]
    hvd.barrier()
    assert 0 <= hvd.join() < n


def _autograd() -> None:
    import hvd_spark.torch as hvd

    hvd.init()
    r = hvd.rank()
    x = torch.full((2,), float(r + 1), requires_grad=True)
    hvd.allreduce(x * x, op=hvd.Sum, name="ar").sum().backward()
    # Every rank's loss depends on every x: d(sum of ranks' losses)/dx = size * 2x.
    assert torch.equal(x.grad, torch.full((2,), 4.0 * (r + 1))), x.grad
    y = torch.full((r + 1, 2), 1.0, requires_grad=True)
    (hvd.allgather(y, name="ag") * (r + 1)).sum().backward()
    # As Horovod: allgather and broadcast send back the ranks' *average* gradient.
    assert torch.equal(y.grad, torch.full((r + 1, 2), 1.5)), y.grad
    z = torch.ones(3, requires_grad=True)
    hvd.broadcast(z, root_rank=0, name="bc").sum().backward()
    assert torch.equal(z.grad, torch.full((3,), 1.0 if r == 0 else 0.0)), z.grad


def _synchronous_paths() -> None:
    """Synchronous calls take the numpy API's synchronous path: a 128 KB tensor rides
    with its negotiation (two ranks decide it alone), an async one of that size goes
    through the ring; in place keeps the memory; a process set is honoured."""
    import time

    import numpy as np

    import hvd_spark.torch as hvd
    from hvd_spark.collectives import _plumbing
    from hvd_spark.errors import HvdSparkError

    hvd.init()
    r = hvd.rank()
    engine = _plumbing.current_engine()
    big = torch.full((32 * 1024,), float(r + 1))  # 128 KB: over the asynchronous limit
    before = engine.paired
    assert torch.equal(hvd.allreduce(big, op=hvd.Sum), torch.full_like(big, 3.0))
    ptr = big.data_ptr()
    assert hvd.allreduce_(big, op=hvd.Sum) is big and big.data_ptr() == ptr
    assert torch.equal(big, torch.full_like(big, 3.0))
    g = torch.full((32 * 1024,), float(r + 1), requires_grad=True)
    hvd.allreduce(g, op=hvd.Sum, name="sync.grad").sum().backward()
    assert torch.equal(g.grad, torch.full_like(g, 2.0))
    assert engine.paired - before == 4, engine.paired - before  # two, autograd's two
    before = engine.paired
    h = hvd.allreduce_async(torch.full((32 * 1024,), float(r)), op=hvd.Sum)
    assert torch.equal(hvd.synchronize(h), torch.ones(32 * 1024))
    assert engine.paired == before  # the ring
    # A bad argument on one rank fails that rank at once and its peer promptly.
    started = time.monotonic()
    try:
        if r == 0:
            hvd.allreduce_(np.ones(3), name="not.a.tensor")
        else:
            hvd.allreduce_(torch.ones(3), name="not.a.tensor")
        raise AssertionError("accepted")
    except HvdSparkError as exc:
        assert "not.a.tensor" in str(exc) or "tensor" in str(exc), exc
    assert time.monotonic() - started < 5
    alone = [hvd.add_process_set([0]), hvd.add_process_set([1])][r]
    x = torch.full((3,), float(r + 5))
    assert torch.equal(hvd.allreduce_(x, op=hvd.Sum, process_set=alone), torch.full((3,), r + 5.0))
    hvd.barrier()  # rank 0 coordinates rank 1's set too: it must not leave first


def _broadcast_state() -> None:
    import hvd_spark.torch as hvd

    hvd.init()
    r = hvd.rank()
    torch.manual_seed(r)  # different models per rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1 if r == 0 else 0.5)
    if r == 0:  # only the root has (lazily created) Adam state
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state_dict()
    assert opt.param_groups[0]["lr"] == 0.1 and len(state["state"]) == 4
    mine = {k: v.clone() for k, v in model.state_dict().items()}
    flat = torch.cat([v.double().flatten() for v in mine.values()]
                     + [v.double().flatten() for s in state["state"].values() for v in s.values()])
    everyone = hvd.allgather(flat.unsqueeze(0))
    assert torch.equal(everyone[0], everyone[1])
    # SGD momentum buffers created on the root only arrive everywhere.
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if r == 0:
        model(torch.randn(5, 4)).sum().backward()
        sgd.step()
        sgd.zero_grad()
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    assert len(sgd.state_dict()["state"]) == 4
    # Then one synchronized step (with synchronize + skip_synchronize) keeps ranks equal.
    dist = hvd.DistributedOptimizer(sgd, model.named_parameters())
    model(torch.randn(5, 4) * (r + 1)).sum().backward()
    dist.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with dist.skip_synchronize():
        dist.step()
    dist.zero_grad()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = hvd.allgather(params.unsqueeze(0))
    assert torch.equal(gathered[0], gathered[1])


def _sync_batch_norm() -> None:
    import hvd_spark.torch as hvd

    hvd.init()
    r = hvd.rank()
    torch.manual_seed(0)
    x = torch.randn(8, 3, 5, dtype=torch.float64)
    sync = hvd.SyncBatchNorm(3).double()
    ref = torch.nn.BatchNorm1d(3).double()
    with torch.no_grad():
        for bn in (sync, ref):
            bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
            bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    xr = x[r * 4 : (r + 1) * 4].clone().requires_grad_(True)
    xf = x.clone().requires_grad_(True)
    out = sync(xr)
    (out * out).mean().backward()
    ref_out = ref(xf)
    (ref_out * ref_out).mean().backward()
    torch.testing.assert_close(out, ref_out[r * 4 : (r + 1) * 4])
    # Rank loss is a mean over half the batch: its input gradient is twice the full one.
    torch.testing.assert_close(xr.grad, 2 * xf.grad[r * 4 : (r + 1) * 4])
    weight_grad = hvd.allreduce(sync.weight.grad)
    torch.testing.assert_close(weight_grad, ref.weight.grad)
    torch.testing.assert_close(sync.running_var, ref.running_var)
    torch.testing.assert_close(sync.running_mean, ref.running_mean)


def _mismatched_shapes() -> str:
    import hvd_spark.torch as hvd
    from hvd_spark.errors import CollectiveError

    hvd.init()
    try:
        hvd.allreduce(torch.zeros(hvd.rank() + 2), name="grads.fc1")
    except CollectiveError as exc:
        return str(exc)
    raise AssertionError("mismatched shapes were accepted")


def _optimizer_misuse() -> str:
    import hvd_spark.torch as hvd
    from hvd_spark.errors import ConfigError

    hvd.init()
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters())
    model(torch.ones(1, 2)).sum().backward()
    try:
        model(torch.ones(1, 2)).sum().backward()
    except ConfigError as exc:
        opt.synchronize()
        return str(exc)
    raise AssertionError("a second backward before step() was accepted")


@pytest.fixture(scope="module")
def two_ranks():
    def call(fn):
        return run_local(fn, num_proc=2)
    return call


def test_collectives(two_ranks):
    two_ranks(_collectives)


def test_autograd(two_ranks):
    two_ranks(_autograd)


def test_synchronous_calls_ride_larger_and_honour_process_sets(two_ranks):
    two_ranks(_synchronous_paths)


def test_broadcast_parameters_and_optimizer_state(two_ranks):
    two_ranks(_broadcast_state)


def test_sync_batch_norm_matches_full_batch_norm(two_ranks):
    two_ranks(_sync_batch_norm)


def test_mismatched_shapes_fail_clearly_on_every_rank(two_ranks):
    messages = two_ranks(_mismatched_shapes)
    for msg in messages:
        assert "grads.fc1" in msg and "shape" in msg


def test_backward_twice_before_step_is_a_clear_error(two_ranks):
    for msg in two_ranks(_optimizer_misuse):
        assert "backward_passes_per_step" in msg and "gradient of '" in msg


def test_worker_error_is_reported_not_hung():
    def bad():
        import hvd_spark.torch as hvd

        hvd.init()
        hvd.allreduce([1.0, 2.0])

    with pytest.raises(WorkerFailedError, match="torch.Tensor"):
        run_local(bad, num_proc=2)
