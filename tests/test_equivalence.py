"""Training under deeppool gives the parameters of single-device training at the same global batch.

SGD with momentum (Adam would hide clipping bugs), gradient clipping by global norm, gradient
accumulation; 2, 3 and 4 ranks; pinned plans that mix widths (non-powers of two too) and automatic
plans; a data-parallel plan (which runs as DDP does); a short last batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
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

TOLERANCE = 1e-5


@dataclass(frozen=True)
class Case:
    model: str
    world_size: int
    plan: dict[str, int] | None
    local_batch: int = 8
    samples: int = 0  # default: four global batches (no padded samples in DistributedSampler)
    trainer: dict[str, Any] = field(default_factory=dict)
    expected_widths: dict[str, int] = field(default_factory=dict)

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.world_size

    @property
    def dataset_size(self) -> int:
        return self.samples or 4 * self.global_batch


CASES = {
    "mlp-2-ranks-accumulate-clip": Case(
        "mlp",
        2,
        {"": 2, "head": 1},
        trainer={"max_steps": 3, "accumulate_grad_batches": 2, "gradient_clip_val": 0.5},
        expected_widths={"body_0": 2, "head": 1},
    ),
    "convnet-3-ranks-widths-3-2-1": Case(
        "convnet",
        3,
        {"": 3, "features.2": 2, "head": 1},
        trainer={"max_steps": 4, "gradient_clip_val": 0.5},
        expected_widths={"features_0": 3, "features_2": 2, "head": 1},
    ),
    "resnet-4-ranks-widths-3-2-1-accumulate": Case(
        "resnet",
        4,
        {"": 3, "head": 1, "block2": 2},
        trainer={"max_steps": 2, "accumulate_grad_batches": 2, "gradient_clip_val": 0.5},
        expected_widths={"stem": 3, "block1_0": 3, "block1_2": 3, "block2_0": 2, "block2_2": 2, "head": 1},
    ),
    "concat-3-ranks-automatic-plan": Case(
        "concat", 3, None, trainer={"max_steps": 4, "gradient_clip_val": 0.5}
    ),
    "convnet-2-ranks-data-parallel-accumulate-clip-short-last-batch": Case(
        "convnet",
        2,
        {"": 2},
        samples=30,
        trainer={"max_epochs": 2, "accumulate_grad_batches": 2, "gradient_clip_val": 0.5},
        expected_widths={"features_0": 2, "features_2": 2, "head": 2},
    ),
    "concat-2-ranks-short-last-batch": Case(
        "concat",
        2,
        {"": 2, "right": 1, "head": 1},
        samples=30,
        trainer={"max_epochs": 2},
        expected_widths={"stem": 2, "left": 2, "right_0": 1, "right_2": 1, "head": 1},
    ),
}


def _deeppool_fit(rank: int, case: Case, init: dict[str, torch.Tensor], root: str) -> dict[str, Any]:
    join_lightning_world(rank, case.world_size)
    model = make_model(case.model)
    model.load_state_dict(init)
    strategy = DeepPoolStrategy(plan=case.plan, cache_dir=False, profile_warmup=0, profile_repeats=1)
    trainer = pl.Trainer(
        **trainer_kwargs(devices=case.world_size, strategy=strategy, default_root_dir=root, **case.trainer)
    )
    trainer.fit(model, DataLoader(images(case.dataset_size), batch_size=case.local_batch))
    assert strategy.plan is not None
    return {"params": parameters(model), "widths": strategy.plan.widths(), "steps": trainer.global_step}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def outcome(request, tmp_path_factory) -> tuple[Case, pl.LightningModule, list[dict[str, Any]]]:
    case = CASES[request.param]
    reference = make_model(case.model)
    init = {k: v.clone() for k, v in reference.state_dict().items()}
    reference_fit(reference, images(case.dataset_size), case.global_batch, **case.trainer)
    root = str(tmp_path_factory.mktemp(request.param))
    return case, reference, run_distributed(_deeppool_fit, case.world_size, case, init, root)


def test_parameters_match_single_device_training(outcome):
    _, reference, ranks = outcome
    assert ranks[0]["steps"] > 0
    assert max_param_diff(parameters(reference), ranks[0]["params"]) < TOLERANCE


def test_every_rank_ends_with_rank_zero_parameters(outcome):
    _, _, ranks = outcome
    for result in ranks[1:]:
        assert max_param_diff(ranks[0]["params"], result["params"]) == 0


def test_every_rank_installs_the_pinned_widths(outcome):
    case, _, ranks = outcome
    widths = ranks[0]["widths"]
    assert all(result["widths"] == widths for result in ranks)
    assert set(widths.values()) <= set(range(1, case.world_size + 1))
    assert {layer: widths[layer] for layer in case.expected_widths} == case.expected_widths
