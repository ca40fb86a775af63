"""Drop-in: models and usage patterns nobody here wrote train to one device's weights under deeppool.

Each `zoo.CASES` entry trains on the spawned rank counts its pins name (2 always; 3 for most; 4 for
branches on disjoint ranks) with pins that mix widths, one process world per rank count running its
cases, and on one device over the same global batches; cases whose loss sees each rank's samples as a
batch (BatchNorm, contrastive losses, padding per rank) are compared with Lightning's DDP in the same
world instead.
"""

from __future__ import annotations

from collections.abc import Callable
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
AT = {world: [name for name, case in CASES.items() if world in case.pins] for world in (2, 3, 4)}
BOTH = pytest.mark.parametrize("world", [2, 3], ids=["2-ranks", "3-ranks"])
Trained = tuple[dict[str, Any], dict[str, Any]]  # references, and per case each rank's outcome


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


def _train(world: int, root: str) -> Trained:
    """Every case of `world` trained in one process world: the one-device references, and per case
    each rank's outcome."""
    inits = {name: _fresh(CASES[name]).state_dict() for name in AT[world]}
    results = run_distributed(_zoo, world, world, inits, root, timeout_s=900)
    references = {
        name: _reference(name, CASES[name], world) for name in AT[world] if CASES[name].reference == "single"
    }
    return references, {name: [rank[name] for rank in results] for name in AT[world]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Callable[[int], Trained]:
    """`trained(world)`: each world trained once for the module, whichever test asks first."""
    worlds: dict[int, Trained] = {}

    def at(world: int) -> Trained:
        if world not in worlds:
            worlds[world] = _train(world, str(tmp_path_factory.mktemp("zoo")))
        return worlds[world]

    return at


@pytest.mark.parametrize(
    ("world", "name"),
    [(world, name) for world, names in AT.items() for name in names],
    ids=[f"{world}-ranks-{name}" for world, names in AT.items() for name in names],
)
def test_trains_to_the_reference_weights_with_mixed_widths(trained, world, name):
    _check_trained(trained(world), name)


def _check_trained(trained: Trained, name: str) -> None:
    references, results = trained
    ranks = results[name]
    assert ranks[0]["steps"] > 0
    if CASES[name].data_parallel:
        assert ranks[0]["placements"] == [str(len(ranks))]
    else:
        assert len(ranks[0]["placements"]) >= 2, ranks[0]["placements"]
    if CASES[name].reference == "ddp":
        assert max_param_diff(ranks[0]["ddp"], ranks[0]["state"]) < TOLERANCE
    else:
        assert max_param_diff(parameters(references[name]), ranks[0]["params"]) < TOLERANCE
    for rank in ranks[1:]:
        assert max_param_diff(ranks[0]["params"], rank["params"]) == 0


@BOTH
def test_rank_zero_calls_in_training_step_ran_on_rank_zero_only(trained, world):
    _, results = trained(world)
    calls = [rank["rank_zero_calls"] for rank in results["rank-zero-forward-in-training-step"]]
    assert calls[0] == [True, True]
    assert all(c == [False, False] for c in calls[1:])


@BOTH
def test_rank_zero_callback_logged_after_every_epoch(trained, world):
    _, results = trained(world)
    logged = [rank["logged"] for rank in results["rank-zero-callback-after-epoch"]]
    assert logged[0] == [2]
    assert all(c == [0] for c in logged[1:])


@BOTH
def test_rank_zero_alone_predicts_with_the_trained_weights(trained, world):
    references, results = trained(world)
    name = "rank-zero-callback-after-epoch"
    probe = CASES[name].probe
    assert probe is not None
    with torch.no_grad():
        expected = references[name](probe())
    assert torch.allclose(results[name][0]["prediction"], expected, atol=TOLERANCE)
    assert "prediction" not in results[name][1]


@BOTH
def test_fit_ends_with_the_measured_step_time_once_steps_settle(trained, world):
    _, results = trained(world)
    assert all(rank["measured"] > 0 for rank in results["rank-zero-callback-after-epoch"])  # 8 steps
    assert all(rank["measured"] is None for rank in results["frozen-layer"])  # 3 steps: too few


@pytest.mark.parametrize(
    "name",
    [
        "hf-bert-each-rank-pads-to-its-own-longest",
        "image-size-differs-between-ranks-split-by-height",
        "each-rank-pads-to-its-own-longest-short-last-batch",
    ],
)
@BOTH
def test_steps_where_ranks_batches_differ_in_shape_ran(trained, world, name):
    _, results = trained(world)
    per_rank = [rank["shapes"][0] for rank in results[name]]  # each rank's batch shapes, step by step
    steps = list(zip(*per_rank))
    assert any(len(set(step)) > 1 for step in steps), steps


@BOTH
def test_a_short_last_batch_of_one_sample_per_rank_at_shapes_all_different_ran(trained, world):
    _, results = trained(world)
    last = [rank["shapes"][0][-1] for rank in results["each-rank-pads-to-its-own-longest-short-last-batch"]]
    assert len(set(last)) == world, last  # a run of one sample per shape: a width-2 stage idles a rank
