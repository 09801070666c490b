"""An ``accelerate`` training loop, as written for ``accelerate launch`` / torchrun.

Rank 0 saves the unwrapped model's state dict and the first and last losses to
``--output``.
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = x.sum(dim=1, keepdim=True)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32,
                                       shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    losses = []
    for _ in range(5):
        for xb, yb in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            losses.append(accelerator.gather(loss.detach()).mean().item())
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(),
                   os.path.join(args.output, "model.pt"))
        with open(os.path.join(args.output, "losses.json"), "w") as f:
            json.dump({"losses": losses, "world": accelerator.num_processes,
                       "distributed": str(accelerator.distributed_type)}, f)


if __name__ == "__main__":
    main()
