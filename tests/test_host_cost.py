"""What a steady-state step costs the host: under a plan with narrow layers, no round trip to the
process group's store; the ranks meet once per planned call, once where the step ends and once
before each collective Lightning issues (`self.log(..., sync_dist=True)`, the wait between steps)."""

from __future__ import annotations

import collections
import functools
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_deeppool import DeepPoolStrategy

from distributed import run_distributed
from models import MLP, images, join_lightning_world, trainer_kwargs

WARMUP, COUNTED = 3, 4
STORE_CALLS = ("get", "set", "add", "wait", "check", "compare_set", "multi_get", "multi_set", "delete_key")


class _Counted(pl.Callback):
    """Counts store round trips (by method) and meetings during `COUNTED` steps after `WARMUP`."""

    def __init__(self) -> None:
        self.counting = False
        self.store: collections.Counter[str] = collections.Counter()
        self.meetings = 0
        for kind in (dist.PrefixStore, dist.TCPStore):
            for name in STORE_CALLS:
                setattr(kind, name, self._wrap(name, getattr(kind, name)))

    def _wrap(self, name: str, method: Any) -> Any:
        @functools.wraps(method)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.counting:
                self.store[name] += 1
            return method(*args, **kwargs)

        return counted

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        agreement = trainer.strategy._calls.agreement
        if trainer.global_step == WARMUP:
            self.counting, self.meetings = True, -agreement.meetings
        elif trainer.global_step == WARMUP + COUNTED:
            self.counting, self.meetings = False, self.meetings + agreement.meetings


def _steady_steps(rank: int) -> tuple[dict[str, int], float]:
    join_lightning_world(rank, 2)
    counted = _Counted()
    strategy = DeepPoolStrategy(plan={"": 2, "head": 1}, cache_dir=False, profile_warmup=0, profile_repeats=1)
    trainer = pl.Trainer(
        **trainer_kwargs(devices=2, strategy=strategy, max_steps=WARMUP + COUNTED + 1, callbacks=[counted])
    )
    torch.manual_seed(0)
    trainer.fit(MLP(), DataLoader(images(64), batch_size=4))
    return dict(counted.store), counted.meetings / COUNTED


def test_a_steady_step_under_a_narrow_plan_makes_no_store_round_trip_and_meets_four_times():
    for store, meetings in run_distributed(_steady_steps, 2):
        assert store == {}
        assert meetings == 4  # the planned call, the logged loss, the step's end, the wait between steps
