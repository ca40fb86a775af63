"""A deeppool fit in which one rank is killed in the middle of training (run under torchrun, one
process per node): `python rank_dies.py <rank killed> <at step> <where: 'call' or 'after'>`.

'call': the rank is killed in training_step before its planned call; 'after': at the end of the
step's batch. It prints when; the survivors should stop soon after, naming it."""

import os
import signal
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_deeppool import DeepPoolStrategy

DIES, AT_STEP, WHERE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


class Dies(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def _die_here(self, where: str) -> None:
        if where == WHERE and self.global_rank == DIES and self.trainer.global_step == AT_STEP:
            print(f"rank {DIES} killed at {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._die_here("call")
        (x,) = batch
        return self(x).square().mean()

    def on_train_batch_end(self, *args: Any) -> None:
        self._die_here("after")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    torch.manual_seed(0)
    strategy = DeepPoolStrategy(plan={"": 2, "head": 1}, cache_dir=False, profile_warmup=0, profile_repeats=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_steps=1000, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Dies(), DataLoader(TensorDataset(torch.randn(4000, 8)), batch_size=2))
