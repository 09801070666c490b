"""Train a small PyTorch regression model with hvd_spark, Horovod style.

Run it as local ranks:   hvdrun -np 2 python examples/torch_train.py
or on Spark:             hvd_spark.run(train, num_proc=2)  (``train`` returns the final loss)

Each rank trains on its own shard of a synthetic dataset; DistributedOptimizer
averages the gradients so every rank holds the same model.
"""

from __future__ import annotations

import torch
from torch import nn

import hvd_spark.torch as hvd


def train(epochs: int = 5, batch_size: int = 32, lr: float = 0.05) -> float:
    """Train on this rank's shard; return the final full-data loss (same on every rank)."""
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(1234)  # the same synthetic data on every rank
    x = torch.randn(1024, 10)
    y = x @ torch.linspace(-1.0, 1.0, 10).unsqueeze(1) + 0.1 * torch.randn(1024, 1)
    shard_x, shard_y = x[hvd.rank() :: hvd.size()], y[hvd.rank() :: hvd.size()]

    torch.manual_seed(hvd.rank())  # deliberately different initial weights ...
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # ... made equal here
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    loss_fn = nn.MSELoss()
    for epoch in range(epochs):
        for start in range(0, shard_x.shape[0], batch_size):
            optimizer.zero_grad()
            loss = loss_fn(model(shard_x[start : start + batch_size]),
                           shard_y[start : start + batch_size])
            loss.backward()
            optimizer.step()
        epoch_loss = hvd.allreduce(loss.detach(), name="epoch_loss").item()
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {epoch_loss:.4f}")
    with torch.no_grad():
        return loss_fn(model(x), y).item()


if __name__ == "__main__":
    final = train()
    if hvd.rank() == 0:
        print(f"final loss {final:.4f} on {hvd.size()} ranks")
