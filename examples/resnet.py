"""A small residual network on generated images, trained with a `DeepPoolStrategy` instance.

The residual adds make the layer graph a DAG: the planner gives each convolution its own width and
the runtime redistributes activations where the widths change. The data are random images labelled
by a fixed random "teacher" network, so the task is learnable and nothing is downloaded.

    python examples/resnet.py                 # 2 CPU processes (every GPU when there are two or more)
    python examples/resnet.py --max-steps 3   # smoke test
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_deeppool import DeepPoolStrategy


class Block(nn.Module):
    """Two 3x3 convolutions with a skip connection."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class SmallResNet(pl.LightningModule):
    def __init__(self, channels: int = 32, blocks: int = 3, classes: int = 4, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels))
        self.blocks = nn.Sequential(*(Block(channels) for _ in range(blocks)))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(torch.relu(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("train_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def generated_images(samples: int, size: int, classes: int, seed: int) -> TensorDataset:
    """Random images, labelled by a fixed random linear teacher on their per-channel means."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 3, size, size, generator=g)
    teacher = torch.randn(3, classes, generator=g)
    return TensorDataset(x, (x.mean(dim=(2, 3)) @ teacher).argmax(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (smoke tests)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per device per step")
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    # One device leaves nothing to plan: with fewer than two GPUs, use two CPU processes.
    cuda = torch.cuda.device_count() >= 2
    devices = torch.cuda.device_count() if cuda else 2
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))
    pl.seed_everything(args.seed, verbose=False)
    strategy = DeepPoolStrategy(amplification_limit=2.0, save_plan="outputs/resnet/deeppool_plan.json")
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        default_root_dir="outputs/resnet",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = generated_images(1024, args.image_size, 4, args.seed)
    trainer.fit(SmallResNet(), DataLoader(data, batch_size=args.batch_size, shuffle=True))
    if trainer.is_global_zero:
        metrics = trainer.callback_metrics
        print(f"final train loss {metrics['train_loss']:.3f}, train accuracy {metrics['train_acc']:.3f}")


if __name__ == "__main__":
    main()
