"""Data-parallel training on 2 local ranks with numpy only, gradients averaged by ring allreduce.

A logistic-regression model learns scikit-style synthetic data with plain numpy;
each rank sees only its half of every batch and the ranks stay in lock-step
because their gradients are averaged with ``hvd_spark.collectives.allreduce``.
"""

from __future__ import annotations

import sys

import numpy as np


def make_data(n: int = 4000, dim: int = 20, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A linearly separable-ish binary task with a known answer."""
    rng = np.random.default_rng(seed)
    w_true = rng.normal(size=dim)
    x = rng.normal(size=(n, dim)).astype(np.float32)
    y = (x @ w_true + 0.3 * rng.normal(size=n) > 0).astype(np.float32)
    return x, y


def train(epochs: int = 5, batch: int = 64, lr: float = 0.5) -> dict:
    """Runs on every rank: returns this rank's final weights and per-epoch metrics."""
    import hvd_spark.collectives as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = make_data()
    split = int(0.8 * len(x))
    x_train, y_train, x_test, y_test = x[:split], y[:split], x[split:], y[split:]
    w = np.zeros(x.shape[1], np.float32) if rank == 0 else np.ones(x.shape[1], np.float32)
    w = hvd.broadcast(w, root_rank=0, name="init.w")  # every rank starts from rank 0's weights
    history = []
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(split)
        losses = []
        for start in range(0, split - batch + 1, batch):
            idx = order[start : start + batch][rank::size]  # this rank's half of the batch
            p = 1 / (1 + np.exp(-(x_train[idx] @ w)))
            grad = x_train[idx].T @ (p - y_train[idx]) / len(idx)
            w -= lr * hvd.allreduce(grad.astype(np.float32), name="grad.w")
            losses.append(float(-np.mean(y_train[idx] * np.log(p + 1e-7)
                                         + (1 - y_train[idx]) * np.log(1 - p + 1e-7))))
        loss = float(hvd.allreduce(np.array([np.mean(losses)]), name="epoch.loss")[0])
        acc = float(np.mean(((x_test @ w) > 0) == (y_test > 0.5)))
        if rank == 0:
            print(f"epoch {epoch + 1}/{epochs}: train loss {loss:.4f}, held-out accuracy {acc:.3f}")
        history.append({"loss": loss, "accuracy": acc})
    return {"rank": rank, "weights": w, "history": history}


def main() -> int:
    """Launch 2 local ranks, train, and report what happened."""
    from hvd_spark.runner import run_local

    results = run_local(train, num_proc=2)
    same = all(np.array_equal(results[0]["weights"], r["weights"]) for r in results)
    final = results[0]["history"][-1]
    print(f"ranks: {len(results)}; weights identical on all ranks: {same}; "
          f"final held-out accuracy: {final['accuracy']:.3f}")
    return 0 if same and final["accuracy"] > 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
