"""Training with spatially split layers under Lightning gives one device's parameters (SGD): a conv net
with BatchNorm, a grouped stride-2 convolution, max pooling, a residual add and a concatenation, its
heights split unevenly over 2, 3 and 4 ranks; and a shared global batch of one sample on 2 ranks
(pinned; also accumulating two batches a step, clipped) and 4 (planned automatically)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_deeppool import DeepPoolStrategy

from distributed import run_distributed
from models import (
    TALL,
    images,
    join_lightning_world,
    make_model,
    max_param_diff,
    parameters,
    reference_fit,
    trainer_kwargs,
)

TOLERANCE = 1e-5
STEPS = 3


@dataclass(frozen=True)
class Case:
    world_size: int
    plan: dict[str, Any] | None
    global_batch: int
    shared_batch: bool = False
    expected: tuple[tuple[str, int, int], ...] = ()  # (layer, width, spatial)
    accumulate: int = 1  # batches per optimizer step (gradients clipped when above 1)

    @property
    def trainer(self) -> dict[str, Any]:
        if self.accumulate == 1:
            return {}
        return {"accumulate_grad_batches": self.accumulate, "gradient_clip_val": 0.5}

    @property
    def batches(self) -> int:
        return STEPS * self.accumulate


def split(width: int, spatial: int) -> dict[str, int]:
    return {"width": width, "spatial": spatial}


# BatchNorm ("body.norm") always sees one sample group, so its statistics are one device's.
CASES = {
    "2-ranks-spatial-then-samples": Case(
        2,
        {"": split(2, 2), "body.mix": 2, "body.head": 1},
        global_batch=4,
        expected=(("body_stem", 2, 2), ("body_mix", 2, 1), ("body_head", 1, 1)),
    ),
    "3-ranks-uneven-heights": Case(
        3,
        {"": split(3, 3), "body.down": 2, "body.block": split(2, 2), "body.mix": 1, "body.head": 3},
        global_batch=6,
        expected=(("body_norm", 3, 3), ("body_down", 2, 1), ("body_block", 2, 2), ("body_head", 3, 1)),
    ),
    "4-ranks-groups-of-two-parts": Case(
        4,
        {"": split(4, 4), "body.down": split(4, 2), "body.mix": 1, "body.head": 1},
        global_batch=4,
        expected=(("body_stem", 4, 4), ("body_down", 4, 2), ("body_mix", 1, 1)),
    ),
    "2-ranks-one-shared-sample": Case(
        2,
        {"": split(2, 2), "body.mix": 1, "body.head": 1},
        global_batch=1,
        shared_batch=True,
        expected=(("body_stem", 2, 2), ("body_block", 2, 2), ("body_head", 1, 1)),
    ),
    # Gradients summed over the local links only at the last batch of each step, then clipped.
    "2-ranks-one-shared-sample-accumulating": Case(
        2,
        {"": split(2, 2), "body.mix": 1, "body.head": 1},
        global_batch=1,
        shared_batch=True,
        expected=(("body_stem", 2, 2), ("body_head", 1, 1)),
        accumulate=2,
    ),
    # On images this small no split pays: the plan may run everything on rank 0, but must train.
    "4-ranks-one-shared-sample-automatic-plan": Case(4, None, global_batch=1, shared_batch=True),
}


def _fit(rank: int, case: Case, init: dict[str, torch.Tensor], root: str) -> dict[str, Any]:
    join_lightning_world(rank, case.world_size)
    model = make_model("spatial")
    model.load_state_dict(init)
    strategy = DeepPoolStrategy(
        plan=case.plan, shared_batch=case.shared_batch, cache_dir=False, profile_warmup=0, profile_repeats=1
    )
    trainer = pl.Trainer(
        **trainer_kwargs(
            devices=case.world_size, strategy=strategy, default_root_dir=root, max_steps=STEPS, **case.trainer
        )
    )
    local_batch = case.global_batch if case.shared_batch else case.global_batch // case.world_size
    data = images(case.batches * case.global_batch, size=TALL)
    trainer.fit(model, DataLoader(data, batch_size=local_batch))
    assert strategy.plan is not None
    return {
        "params": parameters(model),
        "buffers": {k: v.clone() for k, v in model.state_dict().items() if "running" in k},
        "placements": {name: (p.width, p.spatial) for name, p in strategy.plan.placements().items()},
        "steps": trainer.global_step,
    }


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def outcome(request, tmp_path_factory) -> tuple[Case, pl.LightningModule, list[dict[str, Any]]]:
    case = CASES[request.param]
    reference = make_model("spatial")
    init = {k: v.clone() for k, v in reference.state_dict().items()}
    data = images(case.batches * case.global_batch, size=TALL)
    reference_fit(reference, data, case.global_batch, max_steps=STEPS, **case.trainer)
    root = str(tmp_path_factory.mktemp(request.param))
    return case, reference, run_distributed(_fit, case.world_size, case, init, root)


def test_parameters_and_running_statistics_match_one_device(outcome) -> None:
    _, reference, ranks = outcome
    assert ranks[0]["steps"] == STEPS
    assert max_param_diff(parameters(reference), ranks[0]["params"]) < TOLERANCE
    statistics = {k: v for k, v in reference.state_dict().items() if "running" in k}
    assert max_param_diff(statistics, ranks[0]["buffers"]) < TOLERANCE


def test_every_rank_ends_with_rank_zero_parameters(outcome) -> None:
    _, _, ranks = outcome
    for result in ranks[1:]:
        assert max_param_diff(ranks[0]["params"], result["params"]) == 0


def test_the_plan_splits_samples_by_height(outcome) -> None:
    case, _, ranks = outcome
    placements = ranks[0]["placements"]
    for layer, width, spatial in case.expected:
        assert placements[layer] == (width, spatial), (layer, placements)
    # Only a height split can use more ranks than there are samples.
    assert all(width // spatial <= case.global_batch for width, spatial in placements.values())
