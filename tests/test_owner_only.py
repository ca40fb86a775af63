"""A rank holds only the weights of the layers it runs: from its first optimizer step to the next
refresh, the others are NaN placeholders without storage. Training still gives one device's weights,
checkpoints hold the whole model, resume under another plan and load into a plain module."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_deeppool import DeepPoolStrategy

from distributed import run_distributed
from models import (
    CLASSES,
    MLP,
    images,
    join_lightning_world,
    max_param_diff,
    parameters,
    reference_fit,
    trainer_kwargs,
)

pytestmark = pytest.mark.floors

GLOBAL_BATCH = 16
SAMPLES = 4 * GLOBAL_BATCH  # four steps an epoch
PINS = {"": 2, "head": 1}  # rank 1 does not run the head
OTHER_PINS = {"": 2, "body": 1}  # ... and under this plan it does, but not the body
MID = "epoch=0-step=4.ckpt"
TOLERANCE = 1e-5


class HeavyHead(MLP):
    """The MLP with a parameter-heavy head: 97% of the parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(32, 2048), nn.ReLU(), nn.Linear(2048, CLASSES))


def heavy_head() -> HeavyHead:
    torch.manual_seed(0)
    return HeavyHead()


class HeadStorage(pl.Callback):
    """What the head's weights are on this rank after the fit's second optimizer step: storage bytes,
    NaN, and whether the storage each held at the start of training was freed."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}
        self._at_start: list[int] = []
        self._steps = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._at_start = [p.untyped_storage()._weak_ref() for p in pl_module.head.parameters()]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self._steps += 1
        if self._steps != 2:
            return
        head = list(pl_module.head.parameters())
        self.seen = {
            "storage_bytes": [p.untyped_storage().nbytes() for p in head],
            "param_bytes": [p.numel() * p.element_size() for p in head],
            "nan": all(bool(p.isnan().all()) for p in head),
            "freed": [torch.UntypedStorage._expired(ref) for ref in self._at_start],
        }
        for ref in self._at_start:
            torch.UntypedStorage._free_weak_ref(ref)


class WritesHead(pl.Callback):
    """Clips the head's weights in place on every rank after each step (WGAN-style weight clipping)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        pl_module.head[0].weight.data.clamp_(-1.0, 1.0)


def _fit(rank: int, plan: Any, root: str, ckpt_path: str | None, writes: bool = False) -> dict[str, Any]:
    join_lightning_world(rank, 2)
    model = heavy_head()
    probe = HeadStorage()
    callbacks: list[pl.Callback] = [probe, ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1)]
    if writes:
        callbacks.append(WritesHead())
    strategy = DeepPoolStrategy(plan=plan, cache_dir=False, profile_warmup=0, profile_repeats=1)
    trainer = pl.Trainer(
        **trainer_kwargs(
            devices=2,
            strategy=strategy,
            max_epochs=2,
            default_root_dir=root,
            enable_checkpointing=True,
            callbacks=callbacks,
        )
    )
    trainer.fit(model, DataLoader(images(SAMPLES), batch_size=GLOBAL_BATCH // 2), ckpt_path=ckpt_path)
    held = [p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters()]
    return {"params": parameters(model), "during": probe.seen, "held_after": all(held)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("owner_only")
    reference = heavy_head()
    reference_fit(reference, images(SAMPLES), GLOBAL_BATCH, max_epochs=2)
    straight = run_distributed(_fit, 2, PINS, str(root / "straight"), None)
    mid = str(root / "straight" / MID)
    resumed = run_distributed(_fit, 2, OTHER_PINS, str(root / "resumed"), mid)
    return {"root": root, "reference": parameters(reference), "straight": straight, "resumed": resumed}


def test_training_with_owner_only_weights_reaches_one_devices_weights_on_every_rank(runs):
    for rank in (0, 1):
        assert max_param_diff(runs["reference"], runs["straight"][rank]["params"]) < TOLERANCE


def test_a_rank_holds_no_storage_for_the_weights_of_layers_it_does_not_run_during_training(runs):
    during = runs["straight"][1]["during"]
    assert during["storage_bytes"] == [4, 4, 4, 4]  # one fp32 NaN each
    assert during["freed"] == [True] * 4
    assert during["nan"]


def test_rank_zero_holds_every_weight_during_training(runs):
    during = runs["straight"][0]["during"]
    assert during["storage_bytes"] == during["param_bytes"]
    assert during["freed"] == [False] * 4
    assert not during["nan"]


def test_every_rank_holds_every_weight_again_when_fit_ends(runs):
    assert runs["straight"][1]["held_after"]
    assert runs["resumed"][1]["held_after"]


def test_a_checkpoint_saved_under_one_plan_resumes_under_another_like_straight_training(runs):
    assert runs["resumed"][1]["during"]["storage_bytes"] == runs["resumed"][1]["during"]["param_bytes"]
    assert max_param_diff(runs["reference"], runs["resumed"][0]["params"]) < TOLERANCE


def test_the_checkpoint_of_rank_one_s_released_weights_holds_rank_zero_s_values(runs):
    checkpoint = torch.load(runs["root"] / "straight" / MID, weights_only=False)
    plain = heavy_head()
    plain.load_state_dict(checkpoint["state_dict"])
    assert all(bool(p.isfinite().all()) for p in plain.parameters())
    final = torch.load(runs["root"] / "straight" / "epoch=1-step=8.ckpt", weights_only=False)
    plain.load_state_dict(final["state_dict"])
    assert max_param_diff(runs["straight"][0]["params"], parameters(plain)) == 0


def test_writing_a_released_weight_in_place_stops_naming_the_weights_the_rank_and_the_option(tmp_path):
    with pytest.raises(RuntimeError) as raised:
        run_distributed(_fit, 2, PINS, str(tmp_path), None, True)
    message = str(raised.value)
    assert "rank 1 holds no storage for the weights of the layers it does not run" in message
    assert "head.0.weight" in message and "current_weights=True" in message
