"""`DeepPoolStrategy(current_weights=True)` under a plan that runs the head on rank 0 alone: every rank's
copy of the head is current after each optimizer step, so a hand-written EMA of the weights and a weight
norm logged with `sync_dist=True` train as on one device; without it, a NaN such code reduces across
ranks, in validation or in a test after the fit, stops every rank naming the parameters and the option."""

from __future__ import annotations

import contextlib
import copy
import io
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from test_user_state import LogsHeadNorm
from torch import nn
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

TOLERANCE = 1e-5
LOCAL_BATCH = 4
WORLD = 2
DECAY = 0.5


class HandWrittenEma(MLP):
    """timm's `ModelEmaV2` pattern: a deep copy of the network, kept out of the module's parameters,
    updated after every batch and evaluated in validation_step."""

    def __init__(self) -> None:
        super().__init__()
        self._ema = (copy.deepcopy(nn.Sequential(self.body, self.head)),)  # a tuple: not registered

    @property
    def ema(self) -> nn.Module:
        return self._ema[0]

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            for ema_p, p in zip(self.ema.parameters(), [*self.body.parameters(), *self.head.parameters()]):
                ema_p.mul_(DECAY).add_(p, alpha=1 - DECAY)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.ema(x.flatten(1)), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.cross_entropy(self.ema(x.flatten(1)), y), sync_dist=True)


class ForwardsInHook(MLP):
    """Calls the model on a fixed batch in on_train_batch_end, on every rank, and logs its mean output
    synchronized across ranks."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            self.log("probe", self(images(4, seed=1).tensors[0]).mean(), sync_dist=True)


# name -> (module, current_weights, evaluated by validation during fit or by `Trainer.test` after it)
CASES: dict[str, tuple[type[MLP], bool, str]] = {
    "ema-with-current-weights": (HandWrittenEma, True, "validate"),
    "ema-without-current-weights": (HandWrittenEma, False, "validate"),
    "ema-tested-after-fit-with-current-weights": (HandWrittenEma, True, "test"),
    "ema-tested-after-fit-without-current-weights": (HandWrittenEma, False, "test"),
    "head-norm-with-current-weights": (LogsHeadNorm, True, "validate"),
    "forward-in-hook-with-current-weights": (ForwardsInHook, True, "validate"),
}
STEPS = {"max_steps": -1, "max_epochs": 2}


def _data() -> Any:
    return images(4 * LOCAL_BATCH * WORLD, size=(8, 8))


def _results(model: MLP, trainer: pl.Trainer) -> dict[str, Any]:
    ema = parameters(model.ema) if isinstance(model, HandWrittenEma) else None
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {"params": parameters(model), "ema": ema, "logged": logged}


def _fit(name: str, root: str) -> dict[str, Any]:
    cls, current, stage = CASES[name]
    torch.manual_seed(0)
    model = cls()
    pl.seed_everything(SEED, verbose=False)
    strategy = DeepPoolStrategy(
        plan={"": WORLD, "head": 1},
        current_weights=current,
        cache_dir=False,
        profile_warmup=0,
        profile_repeats=1,
    )
    trainer = pl.Trainer(**trainer_kwargs(devices=WORLD, strategy=strategy, default_root_dir=root, **STEPS))
    loader = DataLoader(_data(), batch_size=LOCAL_BATCH)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            trainer.fit(model, loader, loader if stage == "validate" else None)
            if stage == "test":
                trainer.test(model, loader, verbose=False)
    except RuntimeError as err:
        return {"error": str(err)}
    return {**_results(model, trainer), "printed": printed.getvalue()}


def _every_case(rank: int, root: str) -> dict[str, Any]:
    join_lightning_world(rank, WORLD)
    return {name: _fit(name, root) for name in CASES}


def _reference(cls: type[MLP], stage: str = "validate") -> dict[str, Any]:
    torch.manual_seed(0)
    model = cls()
    data = _data()
    evaluation = DataLoader(data, batch_size=LOCAL_BATCH * WORLD)
    validation = evaluation if stage == "validate" else None
    trainer = reference_fit(model, data, LOCAL_BATCH * WORLD, val_dataloaders=validation, **STEPS)
    if stage == "test":
        trainer.test(model, evaluation, verbose=False)
    return _results(model, trainer)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict[str, Any]]:
    return run_distributed(_every_case, WORLD, str(tmp_path_factory.mktemp("current")), timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "stage", "loss"),
    [
        ("ema-with-current-weights", "validate", "val_loss"),
        ("ema-tested-after-fit-with-current-weights", "test", "test_loss"),
    ],
)
def test_hand_written_ema_trains_to_one_devices_ema_weights_and_loss(runs, name, stage, loss):
    expected = _reference(HandWrittenEma, stage)
    for rank in runs:
        result = rank[name]
        assert max_param_diff(expected["params"], result["params"]) < TOLERANCE
        assert max_param_diff(expected["ema"], result["ema"]) < TOLERANCE
        assert abs(result["logged"][loss] - expected["logged"][loss]) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("ema-without-current-weights", "validate epoch"),
        ("ema-tested-after-fit-without-current-weights", "test epoch"),
    ],
)
def test_hand_written_ema_without_current_weights_stops_every_rank_naming_the_parameters_and_the_option(
    runs, name, where
):
    for rank in runs:
        message = rank[name]["error"]
        assert where in message and "head.weight" in message, message
        assert "current_weights=True" in message, message


@pytest.mark.slow
def test_weight_norm_logged_with_sync_dist_trains_as_one_device_logs_it(runs):
    expected = _reference(LogsHeadNorm)
    for rank in runs:
        result = rank["head-norm-with-current-weights"]
        assert max_param_diff(expected["params"], result["params"]) < TOLERANCE
        assert abs(result["logged"]["head_norm"] - expected["logged"]["head_norm"]) < TOLERANCE


@pytest.mark.slow
def test_plan_footer_prints_the_bytes_current_weights_sends_per_step(runs):
    head = MLP().head
    sent = sum(p.numel() * p.element_size() for p in head.parameters())
    assert f"current_weights: rank 0 sends {sent:,} bytes" in runs[0]["ema-with-current-weights"]["printed"]


def _footer_on_three_ranks(rank: int, root: str) -> str:
    """What rank 0 prints of a plan that runs the head on rank 0 alone of three, with current_weights."""
    join_lightning_world(rank, 3)
    torch.manual_seed(0)
    strategy = DeepPoolStrategy(
        plan={"": 3, "head": 1}, current_weights=True, cache_dir=False, profile_warmup=0, profile_repeats=1
    )
    trainer = pl.Trainer(**trainer_kwargs(devices=3, strategy=strategy, default_root_dir=root, max_steps=1))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.fit(MLP(), DataLoader(images(12, size=(8, 8)), batch_size=LOCAL_BATCH))
    return printed.getvalue()


@pytest.mark.slow
def test_plan_footer_counts_what_current_weights_sends_to_each_rank(tmp_path):
    head = MLP().head
    to_each = sum(p.numel() * p.element_size() for p in head.parameters())
    printed = run_distributed(_footer_on_three_ranks, 3, str(tmp_path), timeout_s=300)[0]
    assert f"current_weights: rank 0 sends {2 * to_each:,} bytes" in printed, printed


@pytest.mark.slow
def test_model_called_in_a_hook_on_every_rank_gives_one_devices_output(runs):
    expected = _reference(ForwardsInHook)
    for rank in runs:
        result = rank["forward-in-hook-with-current-weights"]
        assert abs(result["logged"]["probe"] - expected["logged"]["probe"]) < TOLERANCE
