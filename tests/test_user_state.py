"""What user code sees at every hook under a plan that runs the head on rank 0 alone: gradients final by
`on_after_backward`, the norms of gradients a rank does not hold (grad_norm, clip_grad_norm_), weights
of layers a rank does not run (NaN there between refreshes, refreshed for evaluation and at the end of
fit: EMA weight averaging trains), and a clear error on every rank where a reduced value read them."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, EMAWeightAveraging
from lightning.pytorch.utilities import grad_norm
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


class GradientsAfterBackward(MLP):
    """Keeps, per step, the gradient of the first layer (every rank runs it) as on_after_backward
    sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def on_after_backward(self) -> None:
        self.seen.append(self.body[0].weight.grad.detach().clone())


class ClipsByHand(MLP):
    """Clips the gradients of every parameter by their global norm in on_before_optimizer_step."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)


class LogsGradNorms(MLP):
    """Logs Lightning's grad_norm of every parameter, synchronized across ranks."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log_dict(grad_norm(self, norm_type=2), sync_dist=True)


class ClipsByMaxNorm(MLP):
    """Clips by the max-norm, written in configure_gradient_clipping."""

    def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.01, norm_type="inf")


class ClipsByValue(MLP):
    """Clamps every gradient by hand in on_before_optimizer_step."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        torch.nn.utils.clip_grad_value_(self.parameters(), 0.002)


class LogsOneAndMaxGradNorms(MLP):
    """Logs Lightning's grad_norm of orders 1 and max, synchronized across ranks."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log_dict({**grad_norm(self, norm_type=1), **grad_norm(self, norm_type="inf")}, sync_dist=True)


class LogsHeadMeanUnsynced(MLP):
    """Logs the head's mean weight without sync_dist, monitored by EarlyStopping."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("head_mean", self.head.weight.mean())
        return super().training_step(batch, batch_idx)


class LogsHeadNorm(MLP):
    """Logs the head's weight norm every step, synchronized across ranks."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("head_norm", self.head.weight.norm(), sync_dist=True)
        return super().training_step(batch, batch_idx)


def _ema() -> list[pl.Callback]:
    return [EMAWeightAveraging(decay=0.5)]


CASES: dict[str, tuple[type[MLP], Any, dict[str, Any]]] = {
    "gradients-final-at-on-after-backward": (GradientsAfterBackward, list, {}),
    "clip-grad-norm-by-hand": (ClipsByHand, list, {}),
    "grad-norm-logged-with-sync-dist": (LogsGradNorms, list, {}),
    "ema-weight-averaging-with-validation": (MLP, _ema, {"max_steps": -1, "max_epochs": 2}),
    "clip-grad-norm-by-hand-without-validation": (ClipsByHand, list, {}),
    "clip-by-max-norm-in-configure-gradient-clipping": (ClipsByMaxNorm, list, {}),
    "clip-grad-value-by-hand": (ClipsByValue, list, {}),
    "grad-norms-of-orders-one-and-max-logged": (LogsOneAndMaxGradNorms, list, {}),
}
WITHOUT_VALIDATION = {"clip-grad-norm-by-hand-without-validation", "grad-norms-of-orders-one-and-max-logged"}
REFUSED: dict[str, tuple[type[MLP], Any, dict[str, Any]]] = {
    "head-norm-logged": (LogsHeadNorm, list, {}),
    "early-stopping-on-an-unsynced-value-of-a-layer-a-rank-does-not-run": (
        LogsHeadMeanUnsynced,
        lambda: [EarlyStopping(monitor="head_mean", mode="max", patience=100, check_finite=True)],
        {"max_steps": -1, "max_epochs": 3},
    ),
}
STEPS = {"max_steps": 4}


def _data(world: int) -> Any:
    return images(4 * LOCAL_BATCH * world, size=(8, 8))


def _fit(name: str, world: int, root: str) -> dict[str, Any]:
    cls, callbacks, trainer = CASES[name] if name in CASES else REFUSED[name]
    torch.manual_seed(0)
    model = cls()
    pl.seed_everything(SEED, verbose=False)
    strategy = DeepPoolStrategy(
        plan={"": world, "head": 1}, cache_dir=False, profile_warmup=0, profile_repeats=1
    )
    fit = pl.Trainer(
        **trainer_kwargs(
            devices=world,
            strategy=strategy,
            callbacks=callbacks(),
            default_root_dir=root,
            **{**STEPS, **trainer},
        )
    )
    data = _data(world)
    validation = None if name in WITHOUT_VALIDATION else DataLoader(data, batch_size=LOCAL_BATCH)
    fit.fit(model, DataLoader(data, batch_size=LOCAL_BATCH), validation)
    return {
        "params": parameters(model),
        "seen": getattr(model, "seen", None),
        "logged": {k: float(v) for k, v in fit.callback_metrics.items()},
        "widths": sorted(set(strategy.plan.widths().values())) if strategy.plan else [],
    }


def _every_case(rank: int, world: int, root: str) -> dict[str, Any]:
    join_lightning_world(rank, world)
    results: dict[str, Any] = {name: _fit(name, world, root) for name in CASES}
    for name in REFUSED:
        try:
            _fit(name, world, root)
            results[name] = "trained"
        except RuntimeError as err:
            results[name] = str(err)
    return results


def _reference(name: str, world: int) -> dict[str, Any]:
    cls, callbacks, trainer = CASES[name]
    torch.manual_seed(0)
    model = cls()
    data = _data(world)
    fit = reference_fit(
        model,
        data,
        LOCAL_BATCH * world,
        callbacks=callbacks(),
        val_dataloaders=None
        if name in WITHOUT_VALIDATION
        else DataLoader(data, batch_size=LOCAL_BATCH * world),
        **{**STEPS, **trainer},
    )
    return {
        "params": parameters(model),
        "seen": getattr(model, "seen", None),
        "logged": {k: float(v) for k, v in fit.callback_metrics.items()},
    }


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def runs(request, tmp_path_factory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    world = request.param
    ranks = run_distributed(_every_case, world, world, str(tmp_path_factory.mktemp("state")), timeout_s=600)
    return ranks, {name: _reference(name, world) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_trains_to_one_devices_weights_on_every_rank(runs, name):
    ranks, references = runs
    assert ranks[0][name]["widths"] == [1, len(ranks)]
    assert max_param_diff(references[name]["params"], ranks[0][name]["params"]) < TOLERANCE
    for rank in ranks[1:]:
        assert max_param_diff(ranks[0][name]["params"], rank[name]["params"]) == 0


def test_gradients_are_final_on_every_rank_by_on_after_backward(runs):
    ranks, references = runs
    expected = references["gradients-final-at-on-after-backward"]["seen"]
    for rank in ranks:
        seen = rank["gradients-final-at-on-after-backward"]["seen"]
        assert len(seen) == len(expected) == STEPS["max_steps"]
        assert all(torch.allclose(a, b, atol=TOLERANCE) for a, b in zip(seen, expected))


def test_grad_norms_of_gradients_a_rank_does_not_hold_are_logged_as_one_device_logs_them(runs):
    ranks, references = runs
    expected = references["grad-norm-logged-with-sync-dist"]["logged"]
    logged = ranks[0]["grad-norm-logged-with-sync-dist"]["logged"]
    assert {"grad_2.0_norm/head.weight", "grad_2.0_norm_total"} <= set(expected)
    assert all(abs(logged[key] - expected[key]) < TOLERANCE for key in expected if key.startswith("grad_"))


def test_one_and_max_grad_norms_of_gradients_a_rank_does_not_hold_are_logged_as_one_device_logs_them(runs):
    ranks, references = runs
    expected = references["grad-norms-of-orders-one-and-max-logged"]["logged"]
    assert {"grad_1.0_norm/head.weight", "grad_inf_norm/head.weight", "grad_inf_norm_total"} <= set(expected)
    for rank in ranks:
        logged = rank["grad-norms-of-orders-one-and-max-logged"]["logged"]
        assert all(
            abs(logged[key] - expected[key]) < TOLERANCE for key in expected if key.startswith("grad_")
        )


def test_ema_weight_averaging_validates_as_one_device(runs):
    ranks, references = runs
    expected = references["ema-weight-averaging-with-validation"]["logged"]["val_loss"]
    assert all(
        abs(rank["ema-weight-averaging-with-validation"]["logged"]["val_loss"] - expected) < TOLERANCE
        for rank in ranks
    )


def test_a_value_logged_from_a_layer_a_rank_does_not_run_stops_every_rank_naming_it(runs):
    ranks, _ = runs
    for rank in ranks:
        assert "head.weight" in rank["head-norm-logged"]
        assert "rank_zero_only=True" in rank["head-norm-logged"]


def test_early_stopping_on_a_value_from_a_layer_a_rank_does_not_run_stops_every_rank_naming_it(runs):
    ranks, _ = runs
    for rank in ranks:
        message = rank["early-stopping-on-an-unsynced-value-of-a-layer-a-rank-does-not-run"]
        assert "decided differently" in message and "head_mean" in message, message
