"""A deeppool foreground run with hyper-parameter trials trained as background jobs.

    python examples/background_jobs.py            # ~1 minute on 2 CPU ranks
    python examples/background_jobs.py --smoke    # a few steps

The foreground's convolutions run on both ranks and its wide head on rank 0 only, so rank 1 waits
while the head runs: the trials (one learning rate each) train in those idle windows. Each trial
writes ``<root>/trials/lr<lr>.ckpt``; running the script again resumes them.
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_deeppool import BackgroundJob, BackgroundTrainers, DeepPoolStrategy


class Foreground(pl.LightningModule):
    """Cheap convolutions, then a parameter-heavy head (the narrow layers of a burst plan)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16 * 16 * 16, 1024), nn.ReLU(), nn.Linear(1024, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Trial(pl.LightningModule):
    """A small classifier whose learning rate is the hyper-parameter under trial."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)]


def images(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


def trial_data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 20, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="a few steps only")
    parser.add_argument("--strategy", choices=["deeppool", "deeppool_spawn"], default="deeppool")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--root", default="background_jobs_run")
    args = parser.parse_args()

    steps, trial_steps = (24, 5) if args.smoke else (150, 300)
    pl.seed_everything(0)
    jobs = [
        BackgroundJob(
            functools.partial(Trial, lr=lr),
            trial_data,
            max_steps=trial_steps,
            name=f"lr{lr:g}",
            checkpoint_dir=os.path.join(args.root, "trials"),
            checkpoint_every=25,
        )
        for lr in (0.3, 0.1, 0.03)
    ]
    strategy = DeepPoolStrategy(
        start_method="spawn" if args.strategy == "deeppool_spawn" else "popen",
        plan={"features": args.devices, "head": 1, "": args.devices},
        profile_repeats=1,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=steps,
        callbacks=[BackgroundTrainers(jobs)],
        default_root_dir=args.root,
        enable_checkpointing=False,
        enable_progress_bar=False,
        log_every_n_steps=5,
    )
    trainer.fit(Foreground(), DataLoader(images(32 * steps), batch_size=16))


if __name__ == "__main__":
    main()
