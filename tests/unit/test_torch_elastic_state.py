"""TorchState and ElasticSampler as pure logic on one rank (no launcher: a one-rank ring)."""

from __future__ import annotations

import torch

import hvd_spark.torch as hvd


def test_sampler_skips_processed_samples_after_a_reload():
    data = list(range(20))
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    sampler.set_epoch(2)
    order = list(sampler)
    assert sorted(order) == data and len(sampler) == 20
    sampler.record_batch(0, 5)
    sampler.record_batch(1, 5)
    state = sampler.state_dict()
    assert state["epoch"] == 2 and sorted(state["processed_indices"]) == sorted(order[:10])
    again = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    again.load_state_dict(state)
    assert list(again) == order[10:]  # the rest of the epoch, in the same shuffled order
    again.set_epoch(3)
    assert len(again) == 20 and list(again) != order


def test_torch_state_restores_model_optimizer_and_attributes():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    state.epoch = 1
    state.commit()
    committed = [p.detach().clone() for p in model.parameters()]
    momentum = opt.state[model.weight]["momentum_buffer"].clone()
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    state.epoch = 5
    state.restore()
    assert state.epoch == 1
    for p, c in zip(model.parameters(), committed):
        assert torch.equal(p, c)
    assert torch.equal(opt.state[model.weight]["momentum_buffer"], momentum)


def test_commit_reuses_the_snapshot_buffers_and_keeps_them_independent():
    model = torch.nn.Linear(1000, 10)
    state = hvd.elastic.TorchState(model=model)
    first = state._saved_model["weight"]
    with torch.no_grad():
        model.weight.add_(1.0)
    state.commit()
    assert state._saved_model["weight"] is first  # copied into, not reallocated
    assert torch.equal(first, model.weight)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(first, model.weight)


def test_reset_callbacks_run_on_reset():
    calls = []
    state = hvd.elastic.ObjectState(batch=0)
    state.register_reset_callbacks([lambda: calls.append("lr")])
    state.on_reset()
    assert calls == ["lr"]
