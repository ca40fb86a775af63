"""Profiling on the first step: it leaves training untouched, and a cached profile skips it."""

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_deeppool import DeepPoolStrategy

from distributed import run_distributed
from models import SEED, images, join_lightning_world, make_model, parameters, trainer_kwargs

pytestmark = pytest.mark.floors

SAMPLES = 48


def _fit(plan: Any, cache: Path, plan_file: Path) -> tuple[DeepPoolStrategy, dict[str, torch.Tensor]]:
    pl.seed_everything(SEED, verbose=False)
    model = make_model("concat")
    strategy = DeepPoolStrategy(plan=plan, cache_dir=cache, save_plan=plan_file, profile_repeats=2)
    trainer = pl.Trainer(**trainer_kwargs(devices=2, strategy=strategy, max_epochs=1))
    trainer.fit(model, DataLoader(images(SAMPLES), batch_size=8))
    return strategy, parameters(model)


def _three_runs(rank: int, root: str) -> dict[str, Any]:
    join_lightning_world(rank, 2)
    cache, plan_file = Path(root) / "cache", Path(root) / "plan.json"
    profiled, after_profiling = _fit(None, cache, plan_file)
    cached, _ = _fit(None, cache, Path(root) / "again.json")
    given, with_plan_up_front = _fit(str(plan_file), cache, Path(root) / "unused.json")
    return {
        "same_profile": profiled.profile == cached.profile,
        "profiled": profiled.profile is not None,
        "given_profiled": given.profile is not None,
        "same_plan": profiled.plan == cached.plan == given.plan,
        "identical_weights": all(
            torch.equal(after_profiling[name], with_plan_up_front[name]) for name in after_profiling
        ),
    }


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> list[dict[str, Any]]:
    return run_distributed(_three_runs, 2, str(tmp_path_factory.mktemp("planning")))


def test_a_second_run_reuses_the_cached_profile(outcome):
    assert all(rank["profiled"] and rank["same_profile"] for rank in outcome)


def test_a_given_plan_skips_profiling_and_is_the_same_plan(outcome):
    assert all(not rank["given_profiled"] and rank["same_plan"] for rank in outcome)


def test_profiling_does_not_change_the_trained_weights(outcome):
    assert all(rank["identical_weights"] for rank in outcome)
