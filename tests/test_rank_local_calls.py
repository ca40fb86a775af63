"""Calls of the model that only one rank makes, where that rank cannot give one device's result, fail
with advice on that rank; Lightning's spawn launcher then stops the other rank (no hang)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_deeppool import DeepPoolStrategy

from models import MLP, images, trainer_kwargs


class RankOneCallback(pl.Callback):
    """Rank 1 alone calls the model after its second step, when its head is out of date."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step >= 1:
            pl_module(images(2).tensors[0])


class RankOneExtraLoss(MLP):
    """Rank 1 alone adds a term from its own call of the model to the loss."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.global_rank == 1:
            loss = loss + self(x).pow(2).mean()
        return loss


def _fit(model: pl.LightningModule, root: str, **trainer: Any) -> None:
    torch.manual_seed(0)
    strategy = DeepPoolStrategy(
        plan={"": 2, "head": 1}, start_method="spawn", cache_dir=False, profile_warmup=0, profile_repeats=1
    )
    pl.Trainer(
        **trainer_kwargs(devices=2, strategy=strategy, default_root_dir=root, max_steps=3, **trainer)
    ).fit(model, DataLoader(images(64), batch_size=8))


def test_a_rank_one_call_of_stale_layers_asks_for_rank_zero(tmp_path):
    with pytest.raises(Exception, match=r"rank 1 called MLP.forward outside the planned calls.*on rank 0"):
        _fit(MLP(), str(tmp_path), callbacks=[RankOneCallback()])


def test_backpropagating_through_a_rank_one_call_is_refused(tmp_path):
    with pytest.raises(Exception, match=r"rank 1 called RankOneExtraLoss.forward alone .* backpropagated"):
        _fit(RankOneExtraLoss(), str(tmp_path))
