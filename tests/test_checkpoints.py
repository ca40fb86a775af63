"""Checkpoints written under deeppool hold every parameter and all optimizer state, load without
deeppool, and resume on the same or another device count (or one device) with the same result."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_deeppool import DeepPoolStrategy

from distributed import run_distributed
from models import (
    images,
    join_lightning_world,
    make_model,
    max_param_diff,
    parameters,
    reference_fit,
    trainer_kwargs,
)

pytestmark = pytest.mark.floors

GLOBAL_BATCH = 24
SAMPLES = 4 * GLOBAL_BATCH  # four steps an epoch
PINS = {"": 2, "head": 1}  # rank 1 does not own the head: its optimizer is pruned
MID = "epoch=0-step=4.ckpt"
TOLERANCE = 1e-5


def _checkpointing(root: str) -> dict[str, Any]:
    callback = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1)
    return {"callbacks": [callback], "enable_checkpointing": True, "max_epochs": 2, "default_root_dir": root}


def _fit(rank: int, world: int, plan: Any, root: str, ckpt_path: str | None, init: Any) -> dict[str, Any]:
    join_lightning_world(rank, world)
    model = make_model("resnet")
    model.load_state_dict(init)
    strategy = DeepPoolStrategy(plan=plan, cache_dir=False, profile_warmup=0, profile_repeats=1)
    extra = _checkpointing(root) if ckpt_path is None else {"max_epochs": 2, "default_root_dir": root}
    trainer = pl.Trainer(**trainer_kwargs(devices=world, strategy=strategy, **extra))
    data = DataLoader(images(SAMPLES), batch_size=GLOBAL_BATCH // world)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    owned = sum(len(g["params"]) for g in trainer.optimizers[0].param_groups)
    return {"params": parameters(model), "owned": owned, "steps": trainer.global_step}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("checkpoints")
    reference = make_model("resnet")
    init = {k: v.clone() for k, v in reference.state_dict().items()}
    reference_fit(reference, images(SAMPLES), GLOBAL_BATCH, **_checkpointing(str(root / "reference")))
    straight = run_distributed(_fit, 2, 2, PINS, str(root / "deeppool"), None, init)
    mid = str(root / "deeppool" / MID)
    resumed = run_distributed(_fit, 2, 2, PINS, str(root / "resume2"), mid, init)
    three = run_distributed(_fit, 3, 3, None, str(root / "resume3"), mid, init)
    single = make_model("resnet")
    reference_fit(single, images(SAMPLES), GLOBAL_BATCH, ckpt_path=mid, max_epochs=2)
    return {
        "root": root,
        "reference": parameters(reference),
        "straight": straight,
        "resumed": resumed,
        "three": three,
        "single": parameters(single),
    }


def test_training_straight_matches_single_device(runs):
    assert runs["straight"][0]["steps"] == 8
    assert max_param_diff(runs["reference"], runs["straight"][0]["params"]) < TOLERANCE


def test_rank_one_optimizer_is_pruned_to_the_parameters_it_owns(runs):
    total = len(runs["reference"])
    assert runs["straight"][0]["owned"] == total
    assert runs["straight"][1]["owned"] == total - 2  # head.weight, head.bias


def test_mid_training_checkpoint_holds_every_parameter_and_its_optimizer_state(runs):
    ours = torch.load(runs["root"] / "deeppool" / MID, weights_only=False)
    theirs = torch.load(runs["root"] / "reference" / MID, weights_only=False)
    assert max_param_diff(theirs["state_dict"], ours["state_dict"]) < TOLERANCE
    state, expected = ours["optimizer_states"][0]["state"], theirs["optimizer_states"][0]["state"]
    assert sorted(state) == sorted(expected) == list(range(len(runs["reference"])))
    momentum = {str(i): s["momentum_buffer"] for i, s in state.items()}
    assert max_param_diff({str(i): s["momentum_buffer"] for i, s in expected.items()}, momentum) < TOLERANCE


def test_resume_on_the_same_device_count_continues_like_straight_training(runs):
    assert runs["resumed"][0]["steps"] == 8
    assert max_param_diff(runs["straight"][0]["params"], runs["resumed"][0]["params"]) < TOLERANCE


def test_resume_on_three_ranks_with_a_new_plan_continues_like_straight_training(runs):
    assert runs["three"][0]["steps"] == 8
    assert max_param_diff(runs["reference"], runs["three"][0]["params"]) < TOLERANCE


def test_resume_on_one_device_without_deeppool_continues_like_straight_training(runs):
    assert max_param_diff(runs["reference"], runs["single"]) < TOLERANCE


LOAD_PLAINLY = """
import sys, torch
sys.path.insert(0, {tests!r})
from models import ResNet
model = ResNet.load_from_checkpoint({ckpt!r})
assert "lightning_deeppool" not in sys.modules, "loading imported deeppool"
torch.save(dict(model.named_parameters()), {out!r})
"""


def test_checkpoint_loads_with_load_from_checkpoint_in_a_process_without_deeppool(runs, tmp_path):
    ckpt = runs["root"] / "deeppool" / "epoch=1-step=8.ckpt"
    out = tmp_path / "params.pt"
    script = LOAD_PLAINLY.format(tests=str(Path(__file__).parent), ckpt=str(ckpt), out=str(out))
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    loaded = {name: p.detach() for name, p in torch.load(out, weights_only=False).items()}
    assert max_param_diff(runs["straight"][0]["params"], loaded) == 0
