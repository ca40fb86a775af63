"""Drop-in: models and usage patterns nobody here wrote train to one device's weights under deeppool.

Each `zoo.CASES` entry trains on 2 and 3 spawned ranks with pins that mix widths (one process world
per rank count runs every case) and on one device over the same global batches; the BatchNorm ResNet
and the contrastive two-tower model are compared with Lightning's DDP in the same world instead (their
losses see each rank's samples). Cases with branches on disjoint ranks also train on 4 ranks.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_deeppool import DeepPoolStrategy

from distributed import run_distributed
from models import SEED, join_lightning_world, max_param_diff, parameters, reference_fit, trainer_kwargs
from zoo import CASES, BatchShapes, Case, PredictionLogger, RankZeroLogging

TOLERANCE = 1e-5
STEPS = {"max_steps": 3}
ON_FOUR_RANKS = [name for name, case in CASES.items() if 4 in case.pins]


def _trainer(case: Case, **overrides: Any) -> dict[str, Any]:
    return {**STEPS, **case.trainer, **overrides}


def _fresh(case: Case, init: dict[str, torch.Tensor] | None = None) -> pl.LightningModule:
    torch.manual_seed(0)
    model = case.model()
    if init is not None:
        model.load_state_dict(init)
    return model


def _zoo(rank: int, world: int, inits: dict[str, dict[str, torch.Tensor]], root: str) -> dict[str, Any]:
    """Every case of `inits` on this world; per case the trained parameters and buffers, the plan's
    placements and what its rank-0-only calls saw."""
    join_lightning_world(rank, world)
    results = {}
    for name in inits:
        case = CASES[name]
        pl.seed_everything(SEED, verbose=False)  # the distributed sampler's shuffle seed
        data = case.data(4 * case.local_batch * world)
        outcome: dict[str, Any] = {}
        if case.reference == "ddp":
            ddp = _fresh(case, inits[name])
            trainer = pl.Trainer(
                **trainer_kwargs(devices=world, strategy="ddp", default_root_dir=root, **_trainer(case))
            )
            trainer.fit(ddp, _loader(case, data, case.local_batch))
            outcome["ddp"] = {k: v.detach().clone() for k, v in ddp.state_dict().items()}
        model = _fresh(case, inits[name])
        callbacks = case.callbacks()
        strategy = DeepPoolStrategy(
            plan=case.pins[world], cache_dir=False, profile_warmup=0, profile_repeats=1, **case.strategy
        )
        trainer = pl.Trainer(
            **trainer_kwargs(
                devices=world, strategy=strategy, callbacks=callbacks, default_root_dir=root, **_trainer(case)
            )
        )
        fitted = torch.compile(model, backend="eager") if case.compiled else model
        trainer.fit(fitted, _loader(case, data, case.local_batch))
        assert strategy.plan is not None
        if case.probe is not None and rank == 0:
            with torch.no_grad():
                outcome["prediction"] = model(case.probe())
        outcome.update(
            params=parameters(model),
            state={k: v.detach().clone() for k, v in model.state_dict().items()},
            placements=sorted({str(p) for p in strategy.plan.placements().values()}),
            measured=strategy.measured_step_time_s,
            steps=trainer.global_step,
            logged=[len(c.logged) for c in callbacks if isinstance(c, PredictionLogger)],
            shapes=[c.shapes for c in callbacks if isinstance(c, BatchShapes)],
            rank_zero_calls=[hasattr(model, "first_logits"), hasattr(model, "last_logits")]
            if isinstance(model, RankZeroLogging)
            else None,
        )
        results[name] = outcome
    return results


def _loader(case: Case, data: Any, batch_size: int) -> DataLoader:
    return DataLoader(data, batch_size=batch_size, collate_fn=case.collate() if case.collate else None)


def _reference(name: str, case: Case, world: int) -> pl.LightningModule:
    model = _fresh(case)
    reference_fit(
        model,
        case.data(4 * case.local_batch * world),
        case.local_batch * world,
        collate_fn=case.collate() if case.collate else None,
        callbacks=case.callbacks(),
        **_trainer(case, enable_model_summary=False),
    )
    return model


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def zoo(request, tmp_path_factory) -> tuple[int, dict[str, Any], dict[str, Any]]:
    world = request.param
    inits = {name: _fresh(case).state_dict() for name, case in CASES.items()}
    results = run_distributed(_zoo, world, world, inits, str(tmp_path_factory.mktemp("zoo")), timeout_s=900)
    references = {
        name: _reference(name, case, world) for name, case in CASES.items() if case.reference == "single"
    }
    return world, references, {name: [rank[name] for rank in results] for name in CASES}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> tuple[int, dict[str, Any], dict[str, Any]]:
    inits = {name: _fresh(CASES[name]).state_dict() for name in ON_FOUR_RANKS}
    results = run_distributed(_zoo, 4, 4, inits, str(tmp_path_factory.mktemp("zoo")), timeout_s=600)
    references = {
        name: _reference(name, CASES[name], 4) for name in ON_FOUR_RANKS if CASES[name].reference == "single"
    }
    return 4, references, {name: [rank[name] for rank in results] for name in ON_FOUR_RANKS}


@pytest.mark.parametrize("name", list(CASES))
def test_trains_to_the_reference_weights_with_mixed_widths(zoo, name):
    _check_trained(zoo, name)


@pytest.mark.parametrize("name", ON_FOUR_RANKS)
def test_branches_train_to_the_reference_weights_on_four_ranks(four_ranks, name):
    _check_trained(four_ranks, name)


def _check_trained(zoo: tuple[int, dict[str, Any], dict[str, Any]], name: str) -> None:
    _, references, results = zoo
    ranks = results[name]
    assert ranks[0]["steps"] > 0
    assert len(ranks[0]["placements"]) >= 2, ranks[0]["placements"]
    if CASES[name].reference == "ddp":
        assert max_param_diff(ranks[0]["ddp"], ranks[0]["state"]) < TOLERANCE
    else:
        assert max_param_diff(parameters(references[name]), ranks[0]["params"]) < TOLERANCE
    for rank in ranks[1:]:
        assert max_param_diff(ranks[0]["params"], rank["params"]) == 0


def test_rank_zero_calls_in_training_step_ran_on_rank_zero_only(zoo):
    _, _, results = zoo
    calls = [rank["rank_zero_calls"] for rank in results["rank-zero-forward-in-training-step"]]
    assert calls[0] == [True, True]
    assert all(c == [False, False] for c in calls[1:])


def test_rank_zero_callback_logged_after_every_epoch(zoo):
    _, _, results = zoo
    logged = [rank["logged"] for rank in results["rank-zero-callback-after-epoch"]]
    assert logged[0] == [2]
    assert all(c == [0] for c in logged[1:])


def test_rank_zero_alone_predicts_with_the_trained_weights(zoo):
    _, references, results = zoo
    name = "rank-zero-callback-after-epoch"
    probe = CASES[name].probe
    assert probe is not None
    with torch.no_grad():
        expected = references[name](probe())
    assert torch.allclose(results[name][0]["prediction"], expected, atol=TOLERANCE)
    assert "prediction" not in results[name][1]


def test_fit_ends_with_the_measured_step_time_once_steps_settle(zoo):
    _, _, results = zoo
    assert all(rank["measured"] > 0 for rank in results["rank-zero-callback-after-epoch"])  # 8 steps
    assert all(rank["measured"] is None for rank in results["frozen-layer"])  # 3 steps: too few


@pytest.mark.parametrize(
    "name", ["hf-bert-each-rank-pads-to-its-own-longest", "image-size-differs-between-ranks-split-by-height"]
)
def test_steps_where_ranks_batches_differ_in_shape_ran(zoo, name):
    _, _, results = zoo
    per_rank = [rank["shapes"][0] for rank in results[name]]  # each rank's batch shapes, step by step
    steps = list(zip(*per_rank))
    assert any(len(set(step)) > 1 for step in steps), steps
