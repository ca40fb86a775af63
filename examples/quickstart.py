"""Quickstart: train a small CNN on scikit-learn's handwritten digits with ``strategy="deeppool"``.

Runs on 2 CPU processes (or every GPU when there are two or more), prints the plan the strategy chose
and ends with the trained model's accuracy on held-out digits. Nothing is downloaded: the digits
ship inside scikit-learn.

    python examples/quickstart.py            # full run (under 2 minutes on 2 CPU cores)
    python examples/quickstart.py --max-steps 5   # smoke test

The strategy's launcher re-runs this script once per extra device, so everything that trains
sits under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_deeppool  # noqa: F401  (registers strategy="deeppool")


class DigitsCNN(pl.LightningModule):
    """Convolutions (scale well with the batch) feeding a wide linear layer (barely does)."""

    def __init__(self, channels: int = 64, hidden: int = 1024, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
        )
        self.wide = nn.Sequential(nn.Linear(channels * 64, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.wide(self.features(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def digits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Train and held-out splits (80/20, stratified), pixels scaled to [0, 1]."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def accuracy(model: nn.Module, dataset: TensorDataset) -> float:
    x, y = dataset.tensors
    model.eval()
    with torch.no_grad():
        predicted = model(x.to(model.device)).argmax(dim=1).cpu()
    return (predicted == y).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-epochs", type=int, default=15)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (smoke tests)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per device per step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    # One device leaves nothing to plan: with fewer than two GPUs, use two CPU processes.
    cuda = torch.cuda.device_count() >= 2
    devices = torch.cuda.device_count() if cuda else 2
    if not cuda:
        # Every process would otherwise start one thread per core and they would fight over them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))
    pl.seed_everything(args.seed, verbose=False)
    train, held_out = digits(args.seed)
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=devices,
        strategy="deeppool",
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        default_root_dir="outputs/quickstart",  # the strategy writes deeppool_plan.json here
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = DigitsCNN()
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size, shuffle=True))
    if trainer.is_global_zero:
        print(f"held-out accuracy: {accuracy(model, held_out):.3f}", flush=True)


if __name__ == "__main__":
    main()
