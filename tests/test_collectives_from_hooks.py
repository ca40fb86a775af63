"""Collectives issued from Lightning hooks while a plan is installed: the same ones on every rank
complete, in any hook; ones some ranks skip (under a plan with narrow layers or a data-parallel one),
or issue in another order around a model call, stop every rank with an error naming the hook, instead
of hanging."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_deeppool import DeepPoolStrategy

from distributed import run_distributed
from models import (
    MLP,
    SEED,
    images,
    join_lightning_world,
    max_param_diff,
    parameters,
    reference_fit,
    trainer_kwargs,
)

pytestmark = pytest.mark.floors

LOCAL_BATCH = 4
STEPS = 3
HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_validation_epoch_end",
)


class Collectives(MLP):
    """Logs with sync_dist, gathers, broadcasts and waits at a barrier from every hook, on every
    rank, and around the model call in training_step; keeps what the gathers and broadcasts gave."""

    def __init__(self) -> None:
        super().__init__()
        self.gathered: list[list[float]] = []

    def _issue(self, hook: str) -> None:
        if self.trainer.world_size == 1:
            return
        value = torch.tensor(float(self.global_rank))
        self.log(f"{hook}_rank", value, sync_dist=True, reduce_fx="sum")
        self.gathered.append(self.all_gather(value).tolist())
        self.gathered.append([self.trainer.strategy.broadcast(float(self.global_rank) + 10, src=0)])
        self.trainer.strategy.barrier(hook)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._issue("training_step_before_call")
        loss = super().training_step(batch, batch_idx)
        self._issue("training_step_after_call")
        return loss


for _hook in HOOKS:
    setattr(Collectives, _hook, lambda self, *args, _name=_hook: self._issue(_name))


class RankZeroLogsAfterTheStep(MLP):
    def on_train_batch_end(self, *args: Any) -> None:
        if self.global_rank == 0:
            self.log("rank_zero_only_metric", torch.tensor(1.0), sync_dist=True)


class RankZeroLogsInTheStep(MLP):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 0:
            self.log("rank_zero_only_metric", torch.tensor(1.0), sync_dist=True)
        return super().training_step(batch, batch_idx)


class LogsOnOppositeSidesOfTheCall(MLP):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 0:
            self.log("first", torch.tensor(1.0), sync_dist=True)
        loss = super().training_step(batch, batch_idx)
        if self.global_rank != 0:
            self.log("first", torch.tensor(1.0), sync_dist=True)
        return loss


class RankZeroWaitsAtEpochEnd(MLP):
    def on_train_epoch_end(self) -> None:
        if self.global_rank == 0:
            self.trainer.strategy.barrier("epoch end")


class RankZeroGathersAfterValidation(MLP):
    def on_validation_epoch_end(self) -> None:
        if self.global_rank == 0:
            self.all_gather(torch.tensor(1.0))


NARROW = {"head": 1}  # pins besides {"": world}: the head on rank 0 alone
DATA_PARALLEL: dict[str, int] = {}


def _fit(model: MLP, world: int, root: str, pins: dict[str, int] = NARROW) -> pl.Trainer:
    torch.manual_seed(0)
    pl.seed_everything(SEED, verbose=False)
    strategy = DeepPoolStrategy(
        plan={"": world, **pins}, cache_dir=False, profile_warmup=0, profile_repeats=1
    )
    trainer = pl.Trainer(
        **trainer_kwargs(devices=world, strategy=strategy, max_steps=STEPS, default_root_dir=root)
    )
    data = images(STEPS * LOCAL_BATCH * world)
    trainer.fit(model, DataLoader(data, batch_size=LOCAL_BATCH), DataLoader(data, batch_size=LOCAL_BATCH))
    return trainer


def _every_hook(rank: int, world: int, root: str) -> dict[str, Any]:
    join_lightning_world(rank, world)
    torch.manual_seed(0)
    model = Collectives()
    trainer = _fit(model, world, root)
    return {
        "params": parameters(model),
        "gathered": model.gathered,
        "logged": {k: float(v) for k, v in trainer.callback_metrics.items() if k.endswith("_rank")},
    }


def test_the_same_collectives_from_every_hook_complete_and_train_like_one_device(tmp_path):
    world = 2
    ranks = run_distributed(_every_hook, world, world, str(tmp_path), timeout_s=300)
    torch.manual_seed(0)
    reference = Collectives()
    data = images(STEPS * LOCAL_BATCH * world)
    reference_fit(
        reference,
        data,
        LOCAL_BATCH * world,
        val_dataloaders=DataLoader(data, batch_size=LOCAL_BATCH * world),
        max_steps=STEPS,
    )
    assert max_param_diff(parameters(reference), ranks[0]["params"]) < 1e-5
    assert max_param_diff(ranks[0]["params"], ranks[1]["params"]) == 0
    assert ranks[0]["gathered"] == ranks[1]["gathered"]
    assert [0.0, 1.0] in ranks[0]["gathered"] and [10.0] in ranks[0]["gathered"]
    assert {f"{hook}_rank" for hook in HOOKS} <= set(ranks[0]["logged"])
    assert all(value == 1.0 for value in ranks[0]["logged"].values())  # 0 + 1, summed over the ranks


def _mismatched(rank: int, world: int, root: str, model: type[MLP], pins: dict[str, int] = NARROW) -> str:
    join_lightning_world(rank, world)
    torch.manual_seed(0)
    try:
        _fit(model(), world, root, pins)
    except Exception as err:
        return "\n".join([str(err), *getattr(err, "__notes__", [])])
    return "trained"


def test_a_collective_some_ranks_skip_stops_every_rank_naming_it(tmp_path):
    found = run_distributed(_mismatched, 2, 2, str(tmp_path), RankZeroLogsAfterTheStep, timeout_s=120)
    for message in found:
        assert "different collectives" in message and "on_train_batch_end (reduce)" in message, found


@pytest.mark.parametrize(
    ("model", "hook"),
    [
        (RankZeroWaitsAtEpochEnd, "on_train_epoch_end (barrier)"),
        (RankZeroGathersAfterValidation, "on_validation_epoch_end (all_gather)"),
    ],
)
def test_a_collective_one_rank_issues_after_the_last_step_stops_every_rank_naming_it(tmp_path, model, hook):
    found = run_distributed(_mismatched, 2, 2, str(tmp_path), model, timeout_s=120)
    for message in found:
        assert "different collectives" in message and hook in message and "the end of training" in message, (
            found
        )


@pytest.mark.parametrize(
    ("model", "hook"),
    [
        (RankZeroLogsAfterTheStep, "on_train_batch_end (reduce)"),
        (RankZeroLogsInTheStep, "training_step (reduce)"),
    ],
)
def test_under_a_data_parallel_plan_a_collective_some_ranks_skip_stops_every_rank_naming_it(
    tmp_path, model, hook
):
    found = run_distributed(_mismatched, 2, 2, str(tmp_path), model, DATA_PARALLEL, timeout_s=120)
    for message in found:
        assert "different collectives" in message and hook in message, found


def test_calls_on_opposite_sides_of_a_collective_stop_every_rank_naming_it(tmp_path):
    """The collectives pair up, as under DDP; the calls cannot, so none runs the plan."""
    found = run_distributed(_mismatched, 2, 2, str(tmp_path), LogsOnOppositeSidesOfTheCall, timeout_s=120)
    assert all("made by every rank at the same point" in message for message in found), found
    assert any("issues a collective from training_step (reduce)" in message for message in found), found
