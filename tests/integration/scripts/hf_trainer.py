"""A Hugging Face ``Trainer`` script, as written for ``torchrun --nproc-per-node 2``.

A tiny BERT built from a config (nothing downloaded) learns which of two token ranges a
sequence was drawn from. Rank 0 saves the model and writes the first and last logged
losses to ``--output``/losses.json.
"""

import argparse
import json
import os

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        low = torch.randint(5, 50, (n, 16), generator=g)
        self.ids = torch.where(self.labels[:, None] == 1, low + 50, low)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", required=True)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=32, num_labels=2)
    model = BertForSequenceClassification(config)
    training = TrainingArguments(
        output_dir=args.output, max_steps=args.steps, per_device_train_batch_size=16,
        learning_rate=5e-3, logging_steps=5, save_strategy="no", report_to=[],
        use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(512))
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    if trainer.is_world_process_zero():
        trainer.save_model(os.path.join(args.output, "model"))
        with open(os.path.join(args.output, "losses.json"), "w") as f:
            json.dump({"losses": losses, "world": training.world_size}, f)


if __name__ == "__main__":
    main()
