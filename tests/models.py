"""Small LightningModules and run helpers shared by the strategy's end-to-end tests.

Every model is a classifier of 3x8x8 images into 4 classes with no dropout and no batch statistics,
so training under deeppool must match single-device training at the same global batch; the spatial
model classifies taller images (`TALL`) with BatchNorm, which matches when its layer sees one sample
group. This module
never imports lightning_deeppool: checkpoints are loaded through it in a plain process.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, TensorDataset

CLASSES = 4
SEED = 7


class Classifier(pl.LightningModule):
    """Cross-entropy training, validation, test and predict steps; SGD with momentum, optionally a
    per-step StepLR (gamma 0.5)."""

    def __init__(self, lr: float = 0.1, momentum: float = 0.9, scheduler: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.val_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.test_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.val_accuracy(logits, y)
        self.log("val_acc", self.val_accuracy)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("test_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.test_accuracy(logits, y)
        self.log("test_acc", self.test_accuracy)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
        if not self.hparams.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class MLP(Classifier):
    """Flatten, two hidden layers, a linear head."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.body = nn.Sequential(nn.Linear(192, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x.flatten(1)))


class ConvNet(Classifier):
    """Two convolutions and a linear head on the flattened feature map."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()
        )
        self.head = nn.Linear(8 * 8 * 8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class ResNet(Classifier):
    """A stem and two residual blocks (skip additions), then a linear head."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.block2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.head = nn.Linear(8 * 8 * 8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))
        y = torch.relu(y + self.block1(y))
        y = torch.relu(y + self.block2(y))
        return self.head(y.flatten(1))


class ConcatNet(Classifier):
    """Two branches of different depth from one stem, concatenated along channels, then a head."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.left = nn.Conv2d(8, 4, 1)
        self.right = nn.Sequential(nn.Conv2d(8, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.head = nn.Linear(8 * 8 * 8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))
        z = torch.cat([self.left(y), self.right(y)], dim=1)
        return self.head(torch.relu(z).flatten(1))


TALL = (22, 6)  # height and width of the spatial model's images: 22 rows split in 3 or 4 is uneven


class SpatialBody(nn.Module):
    """Layers (default granularity): stem, norm (BatchNorm, ReLU), down (grouped stride-2 conv, max
    pooling), block (residual block, channel concatenation), mix (1x1 conv), head (flatten, linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.norm = nn.BatchNorm2d(6)
        self.down = nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=2)
        self.pool = nn.MaxPool2d(2)
        self.block = nn.Conv2d(6, 6, 3, padding=1)
        self.mix = nn.Conv2d(12, 4, 1)
        self.head = nn.Linear(4 * (TALL[0] // 4) * (TALL[1] // 4), CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.stem(x)))
        x = self.pool(torch.relu(self.down(x)))
        x = self.mix(torch.cat([torch.relu(self.block(x) + x), x], 1))
        return self.head(x.flatten(1))


class SpatialNet(Classifier):
    """`SpatialBody` as a classifier of `TALL` images."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.body = SpatialBody()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


MODELS: dict[str, type[Classifier]] = {
    "mlp": MLP,
    "convnet": ConvNet,
    "resnet": ResNet,
    "concat": ConcatNet,
    "spatial": SpatialNet,
}


def make_model(name: str, seed: int = 0, **kwargs: Any) -> Classifier:
    """A fresh model whose initial weights depend only on `seed`."""
    torch.manual_seed(seed)
    return MODELS[name](**kwargs)


def images(n: int, seed: int = 0, size: tuple[int, int] = (8, 8)) -> TensorDataset:
    """`n` random 3-channel images of `size` with labels in 0..CLASSES-1, the same for a given seed."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, *size, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    """Trainer arguments shared by every test run: CPU, no logger, no progress bar."""
    return {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        **overrides,
    }


class Batches(IterableDataset):
    """These batches, in order, on every rank that reads it (Lightning does not shard an iterable)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def reference_loader(
    dataset: Dataset,
    global_batch: int,
    seed: int = SEED,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader:
    """The global batches Lightning's shuffling DistributedSampler gives every deeppool rank, in one
    process: the same permutation (seeded like PL_GLOBAL_SEED), `global_batch` samples a step."""
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=global_batch, sampler=sampler, collate_fn=collate_fn)


def reference_fit(
    model: pl.LightningModule,
    dataset: Dataset,
    global_batch: int,
    *,
    seed: int = SEED,
    ckpt_path: str | None = None,
    val_dataloaders: DataLoader | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **overrides: Any,
) -> pl.Trainer:
    """Train `model` on one device over the same global batches a distributed run would see."""
    pl.seed_everything(seed, verbose=False)
    trainer = pl.Trainer(**trainer_kwargs(devices=1, use_distributed_sampler=False, **overrides))
    loader = reference_loader(dataset, global_batch, seed, collate_fn)
    trainer.fit(model, loader, val_dataloaders, ckpt_path=ckpt_path)
    return trainer


class LossLog(pl.Callback):
    """The training loss of every step, as a float."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))


def fit_one_device(
    strategy: Any, steps: int = 6, **overrides: Any
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train the convnet classifier `steps` steps on one device under `strategy`, in this process:
    its parameters and per-step losses. The environment and process group a distributed strategy
    sets up here are undone, so later tests' launchers do not think they were started by one."""
    model = make_model("convnet")
    log = LossLog()
    pl.seed_everything(SEED, verbose=False)
    kwargs = trainer_kwargs(devices=1, max_steps=steps, strategy=strategy, callbacks=[log], **overrides)
    environ = dict(os.environ)
    try:
        with tempfile.TemporaryDirectory() as root:  # the plan file lands there
            pl.Trainer(default_root_dir=root, **kwargs).fit(model, DataLoader(images(64), batch_size=8))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    return parameters(model), log.losses


def max_param_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of a model's parameters, by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def join_lightning_world(rank: int, world_size: int) -> None:
    """Let a Trainer inside a `run_distributed` rank use the process group that is already up
    (Lightning then launches no processes: LOCAL_RANK says they were created externally)."""
    os.environ.update(
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
    )
