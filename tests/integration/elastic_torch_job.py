"""An elastic torch training script for tests/integration/test_elastic_local.py.

Worker KILL_WORKER (default "1") sends itself signal SIG (default SIGKILL) at step KILL_AT.
Each rank prints its commits, every (re)start and a final checksum of the parameters.
SLOW_EXIT_S: every rank's exit takes that long after training (an atexit handler that runs
after hvd_spark's own), as a loaded host's or a large framework's teardown does.
"""
import atexit
import os
import signal
import time

import torch

import hvd_spark.torch as hvd

STEPS_PER_EPOCH = 8
EPOCHS = int(os.environ.get("EPOCHS", "4"))
KILL_AT = int(os.environ.get("KILL_AT", "-1"))
SIG = int(os.environ.get("SIG", str(int(signal.SIGKILL))))
# Keep stepping past the last epoch until the ring has this many ranks (a replacement
# joined), for at most 120 s: makes the replacement test independent of start-up speed.
WAIT_FOR_SIZE = int(os.environ.get("WAIT_FOR_SIZE", "0"))
DEADLINE = time.monotonic() + 120

# Registered before init() registers hvd_spark's handlers: atexit runs it after them.
atexit.register(time.sleep, float(os.environ.get("SLOW_EXIT_S", "0")))
hvd.init()
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=1)
state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, step=0)
me = os.environ["HVD_SPARK_WORKER_ID"]


@hvd.elastic.run
def train(state):
    print(f"start step={state.step} size={hvd.size()} rank={hvd.rank()}", flush=True)
    while state.step < EPOCHS * STEPS_PER_EPOCH or (
            hvd.size() < WAIT_FOR_SIZE and time.monotonic() < DEADLINE):
        if state.step % STEPS_PER_EPOCH == 0:
            state.sampler.set_epoch(state.step // STEPS_PER_EPOCH)
        loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=state.sampler)
        for i, (x, y) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.sampler.record_batch(i, 8)
            state.step += 1
            if state.step == KILL_AT and me == os.environ.get("KILL_WORKER", "1"):
                os.kill(os.getpid(), SIG)
            if state.step % 2 == 0:
                state.commit()
                print(f"commit step={state.step} size={hvd.size()} loss={loss.item():.5f}",
                      flush=True)
            if WAIT_FOR_SIZE:
                time.sleep(0.05)
            if state.step % STEPS_PER_EPOCH == 0:
                break
    return [p.detach().clone() for p in model.parameters()]


params = train(state)
flat = torch.cat([p.flatten() for p in params])
print(f"done step={state.step} size={hvd.size()} rank={hvd.rank()} "
      f"checksum={hvd.allreduce(flat, op=hvd.Max).sum().item():.6f} "
      f"local={flat.sum().item():.6f}", flush=True)
