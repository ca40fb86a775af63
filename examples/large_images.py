"""Large images, a batch smaller than the device count: segmentation with spatial splits.

Trains a small segmentation network on generated 512x512 images (rectangles of three classes on
noise, labelled per pixel) at a global batch of one image on 2 CPU processes (or every GPU when there
are two or more). With ``shared_batch=True`` every process reads the same batch; the strategy plans
how to split each image by height across the devices, and every process gets the whole batch's
outputs back, so the loss is one device's. Nothing is downloaded.

    python examples/large_images.py                          # 512x512, 20 steps
    python examples/large_images.py --size 64 --max-steps 3  # smoke test

The strategy's launcher re-runs this script once per extra device, so everything that trains sits
under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_deeppool import DeepPoolStrategy

CLASSES = 4  # background and three kinds of rectangle


def _stage(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(inputs, outputs, 3, padding=1),
        nn.BatchNorm2d(outputs),
        nn.ReLU(),
        nn.Conv2d(outputs, outputs, 3, padding=1),
        nn.BatchNorm2d(outputs),
        nn.ReLU(),
    )


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x) + x)


class SegNet(pl.LightningModule):
    """Per-pixel classes at a quarter of the input resolution. Every layer is spatially local
    (convolutions, BatchNorm, pooling, a residual add), so every layer can split images by height."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(
            _stage(3, 16), nn.MaxPool2d(2), _stage(16, 32), nn.MaxPool2d(2), Residual(32)
        )
        self.classify = nn.Conv2d(32, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(self.encoder(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, labels = batch
        logits = self(x)
        loss = F.cross_entropy(logits, labels)
        # Every rank holds the whole batch's outputs: no need to reduce across ranks.
        self.log("train_loss", loss, prog_bar=True)
        self.log("pixel_accuracy", (logits.argmax(1) == labels).float().mean())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def rectangles(count: int, size: int, seed: int = 0) -> TensorDataset:
    """`count` noisy RGB images of `size` x `size` with up to six filled rectangles each; a rectangle's
    class sets its colour. Labels are per pixel at a quarter of the resolution."""
    g = torch.Generator().manual_seed(seed)
    colours = torch.tensor([[0.0, 0.0, 0.0], [1.0, -1.0, 0.0], [-1.0, 1.0, 0.5], [0.5, 0.5, -1.0]])
    images = torch.randn(count, 3, size, size, generator=g) * 0.5
    labels = torch.zeros(count, size, size, dtype=torch.long)
    for i in range(count):
        for _ in range(int(torch.randint(1, 7, (), generator=g))):
            kind = int(torch.randint(1, CLASSES, (), generator=g))
            top, left = (int(v) for v in torch.randint(0, size * 3 // 4, (2,), generator=g))
            height, width = (int(v) for v in torch.randint(size // 8, size // 3, (2,), generator=g))
            images[i, :, top : top + height, left : left + width] += colours[kind].view(3, 1, 1)
            labels[i, top : top + height, left : left + width] = kind
    return TensorDataset(images, labels[:, ::4, ::4].contiguous())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=512, help="image height and width")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1, help="the global batch, read by every process")
    args = parser.parse_args()

    cuda = torch.cuda.device_count() >= 2
    devices = torch.cuda.device_count() if cuda else 2
    if not cuda:
        # Every process would otherwise start one thread per core and they would fight over them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=devices,
        strategy=DeepPoolStrategy(shared_batch=True),
        max_steps=args.max_steps,
        default_root_dir="outputs/large_images",  # the strategy writes deeppool_plan.json here
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = SegNet()
    data = rectangles(args.batch_size * args.max_steps, args.size)
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size))
    if trainer.is_global_zero:
        metrics = trainer.callback_metrics
        print(
            f"final train loss {float(metrics['train_loss']):.3f}, "
            f"pixel accuracy {float(metrics['pixel_accuracy']):.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
