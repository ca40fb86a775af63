"""Quickstart: train a small CNN on scikit-learn's handwritten digits with ``strategy="deeppool"``.

Runs on 2 CPU processes (or every GPU when there are two or more), prints the plan the strategy chose
and ends with the trained model's accuracy on held-out digits. Nothing is downloaded: the digits
ship inside scikit-learn. With ``--compare-ddp`` it then trains the same model with Lightning's
``"ddp"`` for as many steps and prints both measured median step times beside the predicted speedup.

    python examples/quickstart.py                 # full run (about a minute on 2 CPU cores)
    python examples/quickstart.py --compare-ddp   # and the same steps under Lightning's DDP
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
from lightning_deeppool.session.step_times import StepTimes


class DigitsCNN(pl.LightningModule):
    """Convolutions (scale well with the batch) feeding three wide linear layers (barely do: their
    time goes to their 21M weights, whose gradients DDP would all-reduce every step)."""

    def __init__(self, channels: int = 192, hidden: int = 2560, lr: float = 0.02) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels // 2, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels // 2, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.wide = nn.Sequential(
            nn.Linear(channels * 16, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
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


class StepTimer(pl.Callback):
    """Median wall time between training batch starts, as the strategy measures its own."""

    def __init__(self) -> None:
        self.times = StepTimes()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        self.times.mark()


def fit(strategy: str, args: argparse.Namespace, train: TensorDataset, **limits: int) -> pl.Trainer:
    """Train a fresh, identically seeded model with `strategy`; its trainer."""
    cuda = torch.cuda.device_count() >= 2
    pl.seed_everything(args.seed, verbose=False)
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=torch.cuda.device_count() if cuda else 2,
        strategy=strategy,
        default_root_dir="outputs/quickstart",  # the strategy writes deeppool_plan.json here
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepTimer()],
        **limits,
    )
    trainer.fit(DigitsCNN(), DataLoader(train, batch_size=args.batch_size, shuffle=True))
    return trainer


def compare_with_ddp(deeppool: pl.Trainer, args: argparse.Namespace, train: TensorDataset) -> None:
    """Train as many steps with Lightning's DDP; print both measured median step times beside the
    plan's predicted speedup."""
    ddp = fit("ddp", args, train, max_steps=deeppool.global_step)
    plan, measured = deeppool.strategy.plan, deeppool.strategy.measured_step_time_s
    ddp_s = next(c.times.median_s() for c in ddp.callbacks if isinstance(c, StepTimer))
    if ddp.is_global_zero and plan is not None and measured is not None and ddp_s is not None:
        print(
            f"measured median step time over {deeppool.global_step} steps: deeppool {measured * 1e3:.3f} "
            f"ms, Lightning's DDP {ddp_s * 1e3:.3f} ms: speedup {ddp_s / measured:.2f}x (predicted "
            f"{plan.speedup:.2f}x)",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-epochs", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (smoke tests)")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per device per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compare-ddp", action="store_true", help="then train as many steps with Lightning's DDP, timed"
    )
    args = parser.parse_args()

    # One device leaves nothing to plan: with fewer than two GPUs, use two CPU processes.
    if torch.cuda.device_count() < 2:
        # Every process would otherwise start one thread per core and they would fight over them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    train, held_out = digits(args.seed)
    trainer = fit("deeppool", args, train, max_epochs=args.max_epochs, max_steps=args.max_steps)
    if trainer.is_global_zero:
        print(f"held-out accuracy: {accuracy(trainer.lightning_module, held_out):.3f}", flush=True)
    if args.compare_ddp:
        compare_with_ddp(trainer, args, train)


if __name__ == "__main__":
    main()
