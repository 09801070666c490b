"""Torch's grouped allreduce of CPU tensors: one packed request, on two real ranks."""

from __future__ import annotations

import pytest
import torch  # CI installs it: a missing package is a failure, not a skip

from hvd_spark.runner.local.local_launcher import run_local


def _group(rank: int) -> list[torch.Tensor]:
    """Small float32 (packed), large float32 (on the packed request uncopied, one of them
    transposed), bfloat16 and int64 (alone), a 0-d tensor and one that needs a gradient."""
    gen = torch.Generator().manual_seed(rank)
    small = [torch.randn(s, generator=gen) for s in [(3,), (4, 5), (1,), (17,)] * 3]
    return [*small,
            torch.randn(40, generator=gen).to(torch.bfloat16),
            torch.randint(-50, 50, (9,), generator=gen),
            torch.randn(30000, generator=gen),  # 120 KB
            torch.randn(200, 150, generator=gen).t(),  # 120 KB, not contiguous
            torch.tensor(float(rank + 1)),
            torch.randn(5, generator=gen, requires_grad=True)]


def _grouped_one_request() -> dict:
    import hvd_spark.torch as hvd
    from hvd_spark.collectives import _plumbing

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    engine = _plumbing.current_engine()
    mine, others = _group(r), [_group(k) for k in range(n)]
    originals = [t.detach().clone() for t in mine]
    before = engine.executed_tensors
    outs = hvd.grouped_allreduce(mine, op=hvd.Sum, name="g")
    ran_out = engine.executed_tensors - before
    for i, (out, t) in enumerate(zip(outs, mine)):
        expect = sum(g[i].detach() for g in others)
        assert out.dtype == t.dtype and out.shape == t.shape, (i, out.dtype, out.shape)
        if t.dtype == torch.float32:
            torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-5)
        else:
            assert torch.equal(out, expect.to(t.dtype)), i
    assert all(torch.equal(a.detach(), b) for a, b in zip(mine, originals)), "an input changed"

    # In place: every tensor keeps its memory and gets the average.
    ptrs = [t.data_ptr() for t in mine]
    before = engine.executed_tensors
    with torch.no_grad():
        result = hvd.grouped_allreduce_(mine, name="g_")
    ran_in = engine.executed_tensors - before
    assert all(a is b for a, b in zip(result, mine))
    assert [t.data_ptr() for t in mine] == ptrs
    for i, t in enumerate(mine):
        if t.dtype == torch.int64:
            continue  # integer Average floors; the Sum above covered its bytes
        expect = sum(g[i].detach().double() for g in others) / n
        torch.testing.assert_close(t.detach().double(), expect.to(torch.float64),
                                   rtol=1e-2 if t.dtype == torch.bfloat16 else 1e-6,
                                   atol=1e-2 if t.dtype == torch.bfloat16 else 1e-5)
    # Asynchronous, and through autograd: the gradient is the grouped allreduce of ones.
    handle = hvd.grouped_allreduce_async([torch.ones(3) * r, torch.ones(70000)], op=hvd.Sum)
    small, large = hvd.synchronize(handle)
    assert torch.equal(small, torch.full((3,), float(sum(range(n)))))
    assert torch.equal(large, torch.full((70000,), float(n)))
    x = torch.ones(4, requires_grad=True)
    y = torch.ones(20000, requires_grad=True)
    a, b = hvd.grouped_allreduce([x * (r + 1), y], op=hvd.Sum)
    (a.sum() + b.sum()).backward()
    assert torch.equal(x.grad, torch.full((4,), float(n * (r + 1))))
    assert torch.equal(y.grad, torch.full((20000,), float(n)))
    return {"ran_out": ran_out, "ran_in": ran_in}


def _bad_tensor_on_one_rank() -> str:
    import time

    import hvd_spark.torch as hvd
    from hvd_spark.errors import HvdSparkError

    hvd.init()
    group = [torch.ones(3), torch.ones(30000)]
    if hvd.rank() == 1:
        group.append(torch.ones(2, dtype=torch.complex64))
    else:
        group.append(torch.ones(4))
    start = time.monotonic()
    try:
        hvd.grouped_allreduce(group)
    except HvdSparkError as exc:
        elapsed = time.monotonic() - start
        assert elapsed < 10, f"the failure took {elapsed:.1f} s to arrive"
        # Automatic names stay aligned: the next unnamed group matches on every rank.
        again = hvd.grouped_allreduce([torch.ones(3) * hvd.rank()], op=hvd.Sum)
        assert torch.equal(again[0], torch.ones(3))
        return str(exc)
    raise AssertionError("a complex tensor in the group was accepted")


def _names_and_sets() -> dict:
    import numpy as np

    import hvd_spark.collectives as C
    import hvd_spark.torch as hvd

    hvd.init()
    r = hvd.rank()
    # Unnamed groups of torch (CPU and tensor by tensor: allgather) and of numpy in flight
    # at once take distinct automatic names on every rank.
    handles = [hvd.grouped_allreduce_async([torch.ones(3) * r], op=hvd.Sum),
               hvd.grouped_allgather_async([torch.ones(1, 2) * r]),
               C.grouped_allreduce_async([np.ones(2) * r], op=C.Sum)]
    torch_sum, gathered = hvd.synchronize(handles[0]), hvd.synchronize(handles[1])
    numpy_sum = C.synchronize(handles[2][0])
    assert torch.equal(torch_sum[0], torch.ones(3)) and numpy_sum.tolist() == [1.0, 1.0]
    assert torch.equal(gathered[0], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    # The synchronous (differentiable) grouped allgather and reduce-scatter, unnamed.
    both = hvd.grouped_allgather([torch.full((1, 2), float(r)), torch.ones(1)])
    assert torch.equal(both[0], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert torch.equal(both[1], torch.ones(2))
    blocks = hvd.grouped_reducescatter([torch.ones(4, 2) * (r + 1)], op=hvd.Sum)
    assert torch.equal(blocks[0], torch.full((2, 2), 3.0))
    # A process set reaches the in-place grouped call (rank 1 meanwhile waits in a barrier).
    alone = hvd.add_process_set([0])
    if r == 0:
        t = torch.full((3,), 5.0)
        hvd.grouped_allreduce_([t], op=hvd.Sum, process_set=alone)
        assert torch.equal(t, torch.full((3,), 5.0))
    hvd.barrier()
    # A compressed allreduce keeps its gradient, as Horovod's does.
    x = torch.ones(3, requires_grad=True)
    y = hvd.allreduce(x * (r + 1), op=hvd.Sum, compression=hvd.Compression.fp16)
    z = hvd.grouped_allreduce([x * 2], op=hvd.Sum, compression=hvd.Compression.fp16)[0]
    (y.sum() + z.sum()).backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0 * (r + 1) + 4.0)), x.grad
    # The small results are copies, not neighbouring views of the packed array (keeping
    # one would keep the whole array alive; packing_jobs checks numpy's ownership flags).
    outs = hvd.grouped_allreduce([torch.ones(4), torch.ones(5)], op=hvd.Sum)
    return {"owned": [outs[1].data_ptr() != outs[0].data_ptr() + outs[0].nbytes]}


def _unsendable_dtype_on_one_rank(dtype_name: str) -> str:
    import hvd_spark.torch as hvd
    from hvd_spark.errors import HvdSparkError

    hvd.init()
    odd = torch.zeros(2, dtype=getattr(torch, dtype_name)) if hvd.rank() == 1 else torch.zeros(2)
    try:
        hvd.grouped_allreduce([torch.ones(3), odd])
    except HvdSparkError as exc:
        again = hvd.grouped_allreduce([torch.ones(3) * hvd.rank()], op=hvd.Sum)
        assert torch.equal(again[0], torch.ones(3))  # automatic names still aligned
        return str(exc)
    raise AssertionError(f"a {dtype_name} tensor in the group was accepted")


def test_a_cpu_group_is_one_request_with_right_results():
    for out in run_local(_grouped_one_request, num_proc=2):
        # The packed request (12 small + 2 large float32, the 0-d and the one needing a
        # gradient) counts once; the bfloat16 and int64 tensors go alone.
        assert out == {"ran_out": 3, "ran_in": 3}


@pytest.mark.parametrize("num_proc", [2])
def test_a_bad_tensor_fails_every_rank_at_once(num_proc):
    messages = run_local(_bad_tensor_on_one_rank, num_proc=num_proc)
    for msg in messages:
        assert "complex64" in msg and "view_as_real" in msg, msg


def test_names_process_sets_and_compressed_gradients():
    for out in run_local(_names_and_sets, num_proc=2, env={"HVD_SPARK_TIMEOUT": "20"}):
        assert all(out["owned"]), out


@pytest.mark.parametrize("dtype_name", ["complex32", "float8_e4m3fn"])
def test_a_dtype_numpy_cannot_hold_fails_every_rank_clearly(dtype_name):
    messages = run_local(_unsendable_dtype_on_one_rank, args=(dtype_name,), num_proc=2,
                         env={"HVD_SPARK_TIMEOUT": "20"})
    for msg in messages:
        assert dtype_name in msg and "not supported" in msg, msg
