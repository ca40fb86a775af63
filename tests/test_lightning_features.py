"""Lightning features keep working with the user's code unchanged under deeppool (2 ranks).

One run trains with validation, torchmetrics, `self.log(sync_dist=True)`, a per-step LR scheduler and
clipping by value, then validates, tests and predicts with the same Trainer and with a fresh one
given the saved plan (evaluation runs the module itself on every rank); a second run trains in
bf16-mixed. Everything is compared with one device.
"""

from __future__ import annotations

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

pytestmark = pytest.mark.floors

PINS = {"": 2, "head": 1}
FIT = {"max_steps": 4, "gradient_clip_val": 0.02, "gradient_clip_algorithm": "value"}
BF16 = {"max_steps": 2, "precision": "bf16-mixed"}
TOLERANCE = 1e-5


def _val_data() -> DataLoader:
    return DataLoader(images(32, seed=1), batch_size=8)


def _metrics(results: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(v) for k, v in results[0].items()}


def _features(rank: int, init: dict[str, torch.Tensor], root: str) -> dict[str, Any]:
    join_lightning_world(rank, 2)
    model = make_model("convnet", scheduler=True)
    model.load_state_dict(init)
    plan_file = f"{root}/plan.json"
    strategy = DeepPoolStrategy(
        plan=PINS, save_plan=plan_file, cache_dir=False, profile_warmup=0, profile_repeats=1
    )
    trainer = pl.Trainer(**trainer_kwargs(devices=2, strategy=strategy, default_root_dir=root, **FIT))
    trainer.fit(model, DataLoader(images(64), batch_size=8), _val_data())
    out: dict[str, Any] = {
        "params": parameters(model),
        "fit_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "lrs": [g["lr"] for g in trainer.optimizers[0].param_groups],
        "owned": sum(len(g["params"]) for g in trainer.optimizers[0].param_groups),
    }
    opened = strategy.idle_windows.opened
    out["validate"] = _metrics(trainer.validate(model, _val_data()))
    out["validate_ran_the_plan"] = strategy.idle_windows.opened > opened
    out["test"] = _metrics(trainer.test(model, _val_data()))
    out["predict"] = torch.cat(trainer.predict(model, _val_data()))
    fresh = DeepPoolStrategy(plan=plan_file, cache_dir=False)
    standalone = pl.Trainer(**trainer_kwargs(devices=2, strategy=fresh, default_root_dir=root))
    out["standalone_validate"] = _metrics(standalone.validate(model, _val_data()))
    out["standalone_ran_the_plan"] = fresh.idle_windows.opened > 0

    bf16 = make_model("convnet")
    bf16.load_state_dict(init)
    strategy = DeepPoolStrategy(plan=PINS, cache_dir=False, profile_warmup=0, profile_repeats=1)
    trainer = pl.Trainer(**trainer_kwargs(devices=2, strategy=strategy, default_root_dir=root, **BF16))
    trainer.fit(bf16, DataLoader(images(64), batch_size=8))
    out["bf16"] = parameters(bf16)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    reference = make_model("convnet", scheduler=True)
    init = {k: v.clone() for k, v in reference.state_dict().items()}
    trainer = reference_fit(reference, images(64), 16, val_dataloaders=_val_data_single(), **FIT)
    expected = {
        "fit_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "lrs": [g["lr"] for g in trainer.optimizers[0].param_groups],
        "validate": _metrics(trainer.validate(reference, _val_data_single())),
        "test": _metrics(trainer.test(reference, _val_data_single())),
    }
    with torch.no_grad():
        logits = reference(images(32, seed=1).tensors[0])
    bf16 = make_model("convnet")
    bf16.load_state_dict(init)
    reference_fit(bf16, images(64), 16, **BF16)
    ranks = run_distributed(_features, 2, init, str(tmp_path_factory.mktemp("features")))
    return {
        "ref": parameters(reference),
        "expected": expected,
        "logits": logits,
        "bf16": parameters(bf16),
        "ranks": ranks,
    }


def _val_data_single() -> DataLoader:
    return DataLoader(images(32, seed=1), batch_size=16)


def test_training_with_scheduler_and_clipping_by_value_matches_single_device(runs):
    assert max_param_diff(runs["ref"], runs["ranks"][0]["params"]) < TOLERANCE


def test_scheduler_steps_the_pruned_param_groups_on_every_rank(runs):
    expected = runs["expected"]["lrs"]
    assert expected == [pytest.approx(0.1 * 0.5**4)]
    assert [rank["lrs"] for rank in runs["ranks"]] == [expected, expected]
    assert runs["ranks"][1]["owned"] < runs["ranks"][0]["owned"]


def test_logged_metrics_with_sync_dist_and_torchmetrics_match_single_device(runs):
    expected = runs["expected"]["fit_metrics"]
    assert set(expected) == {"train_loss", "val_loss", "val_acc"}
    for rank in runs["ranks"]:
        assert rank["fit_metrics"] == pytest.approx(expected, abs=TOLERANCE)


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_evaluation_after_fit_matches_single_device(runs, stage):
    for rank in runs["ranks"]:
        assert rank[stage] == pytest.approx(runs["expected"][stage], abs=TOLERANCE)


def test_evaluation_runs_the_module_itself_on_every_rank(runs):
    # Evaluation has no gradients to save: every rank runs every layer on its own samples, as DDP does,
    # so a call that only some ranks make (a rank-0-only callback) cannot hang.
    assert not any(rank["validate_ran_the_plan"] for rank in runs["ranks"])


def test_predict_returns_each_rank_its_samples(runs):
    logits = runs["logits"]
    for r, rank in enumerate(runs["ranks"]):
        assert torch.allclose(rank["predict"], logits[r::2], atol=TOLERANCE)


def test_standalone_validate_with_a_plan_file_matches_single_device(runs):
    for rank in runs["ranks"]:
        assert not rank["standalone_ran_the_plan"]
        assert rank["standalone_validate"] == pytest.approx(runs["expected"]["validate"], abs=TOLERANCE)


def test_bf16_mixed_training_stays_within_bf16_rounding_of_single_device(runs):
    params = runs["ranks"][0]["bf16"]
    assert all(p.dtype == torch.float32 for p in params.values())
    assert max_param_diff(runs["bf16"], params) < 2e-2


class _SigtermOnRankZero(pl.Callback):
    """Rank 0 receives SIGTERM (as Lightning's signal handler records it) after its second step, just
    after Lightning's own check at the end of the batch: its wait before the next step finds it."""

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        loop = trainer.fit_loop.epoch_loop
        on_advance_end = loop.on_advance_end

        def then_sigterm(*args: Any) -> None:
            on_advance_end(*args)
            if trainer.global_rank == 0 and trainer.global_step == 2:
                trainer._signal_connector.received_sigterm = True

        loop.on_advance_end = then_sigterm  # type: ignore[method-assign]


def _stops_on_sigterm(rank: int) -> tuple[str, int]:
    join_lightning_world(rank, 2)
    strategy = DeepPoolStrategy(plan=PINS, cache_dir=False, profile_warmup=0, profile_repeats=1)
    trainer = pl.Trainer(
        **trainer_kwargs(devices=2, strategy=strategy, max_steps=6, callbacks=[_SigtermOnRankZero()])
    )
    try:
        trainer.fit(make_model("mlp"), DataLoader(images(64), batch_size=4))
    except SystemExit as stopped:
        return type(stopped).__name__, trainer.global_step
    return "trained", trainer.global_step


def test_sigterm_on_rank_zero_stops_every_rank_before_the_next_step():
    assert run_distributed(_stops_on_sigterm, 2) == [("SIGTERMException", 2)] * 2
