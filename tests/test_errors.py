"""Bad input fails with a clear error on every rank, without a hang (2 ranks, one run for all)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_deeppool import DeepPoolStrategy, Plan
from lightning_deeppool.capture import capture_graph
from lightning_deeppool.planner.plan import LayerPlan

from distributed import run_distributed
from models import MLP, Batches, ConvNet, images, join_lightning_world, make_model, trainer_kwargs

pytestmark = pytest.mark.floors


class MixingMLP(MLP):
    """Subtracts the batch mean: samples are not independent."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x.flatten(1))
        return self.head(y - y.mean(0, keepdim=True))


class SparseRecommender(pl.LightningModule):
    """User and item embeddings with sparse gradients (`nn.Embedding(sparse=True)`), plain SGD."""

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(40, 8, sparse=True)
        self.items = nn.Embedding(60, 8, sparse=True)
        self.head = nn.Linear(16, 1)

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.users(pairs[:, 0]), self.items(pairs[:, 1])], dim=1)).squeeze(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        pairs, rating = batch
        return F.mse_loss(self(pairs), rating)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def ratings(n: int, seed: int = 0) -> TensorDataset:
    """`n` (user, item) pairs and their ratings."""
    g = torch.Generator().manual_seed(seed)
    pairs = torch.stack([torch.randint(0, 40, (n,), generator=g), torch.randint(0, 60, (n,), generator=g)], 1)
    return TensorDataset(pairs, torch.rand(n, generator=g))


class NoForwardMLP(MLP):
    """training_step uses the layers directly and never calls self(...)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.body(x.flatten(1))), y)


class OneRankChangesAnArgument(MLP):
    """In its second step rank 1 alone calls forward with another value of a non-tensor argument."""

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.head(self.body(x.flatten(1))) * scale

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        scale = 2.0 if batch_idx == 1 and self.global_rank == 1 else 1.0
        return nn.functional.cross_entropy(self(x, scale=scale), y)


class LossInForward(MLP):
    """The loss computed inside forward, a mean over the rank's own samples."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.body(x.flatten(1))), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(*batch)


BURST = {"": 2, "head": 1}


def _plan_for(model: nn.Module, world_size: int) -> Plan:
    graph = capture_graph(model, (images(4).tensors[0],)).graph
    layers = tuple(
        LayerPlan(layer.name, layer.module, 1, 0.0, 0.0, 0.0, layer.params) for layer in graph.layers
    )
    return Plan(world_size, 16, 2.0, 0.0, 0.0, graph.fingerprint, layers)


def _fit_error(
    model: pl.LightningModule, root: str, data: Any = None, steps: int = 1, **strategy: Any
) -> str:
    strategy = DeepPoolStrategy(cache_dir=False, profile_warmup=0, profile_repeats=1, **strategy)
    trainer = pl.Trainer(
        **trainer_kwargs(devices=2, strategy=strategy, max_steps=steps, default_root_dir=root)
    )
    try:
        trainer.fit(model, data or DataLoader(images(32), batch_size=8))
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _all_errors(rank: int, root: str) -> dict[str, str]:
    join_lightning_world(rank, 2)
    other_model, wrong_world = f"{root}/convnet_plan.json", f"{root}/three_ranks_plan.json"
    if rank == 0:
        _plan_for(ConvNet(), 2).save(other_model)
        _plan_for(MLP(), 3).save(wrong_world)
    torch.distributed.barrier()
    x, y = images(1).tensors
    empty = DataLoader([(x, y) if rank == 0 else (x[:0], y[:0])], batch_size=None)
    x8, y8 = images(8).tensors
    # Flattened, both shapes fit the MLP, but rank 1 alone changes shape in step 2. (An iterable
    # dataset: every rank gets both batches, in order.)
    x_rank = x8.reshape(8, 3, 4, 16) if rank == 1 else x8
    one_rank_reshaped = DataLoader(Batches([(x8, y8), (x_rank, y8)]), batch_size=None)
    # A shared batch read with a random flip of its own on rank 1: the same values, elsewhere.
    flipped = DataLoader([(x8.flip(3) if rank == 1 else x8, y8)], batch_size=None)
    return {
        "plan for another model": _fit_error(make_model("mlp"), root, plan=other_model),
        "plan for another world size": _fit_error(make_model("mlp"), root, plan=wrong_world),
        "pins naming no module": _fit_error(make_model("mlp"), root, plan={"classifier": 1}),
        "global batch below world size": _fit_error(make_model("mlp"), root, data=empty),
        "training_step without forward": _fit_error(NoForwardMLP(), root, plan={"": 2}),
        "mixes samples": _fit_error(MixingMLP(), root),
        # A burst plan: a data-parallel one runs each rank's own forward, where both are harmless.
        "one rank's shape changes, loss in forward": _fit_error(
            LossInForward(), root, data=one_rank_reshaped, steps=2, plan=BURST
        ),
        "one rank's arguments change": _fit_error(OneRankChangesAnArgument(), root, steps=2, plan=BURST),
        "sparse gradients": _fit_error(
            SparseRecommender(), root, data=DataLoader(ratings(32), batch_size=8), plan=BURST
        ),
        "shared batch differs": _fit_error(
            make_model("mlp"), root, data=flipped, plan=BURST, shared_batch=True
        ),
        # on CPU: the budget holds activations profiled from saved tensors, not measured memory
        "memory budget below any plan": _fit_error(make_model("mlp"), root, memory_budget_bytes=1000),
    }


@pytest.fixture(scope="module")
def errors(tmp_path_factory) -> list[dict[str, str]]:
    return run_distributed(_all_errors, 2, str(tmp_path_factory.mktemp("errors")))


def _on_every_rank(errors: list[dict[str, str]], case: str) -> str:
    texts = [rank_errors[case] for rank_errors in errors]
    assert all(text != "no error" for text in texts), texts
    return "\n".join(texts)


def test_a_memory_budget_below_any_plan_fails_on_every_rank_naming_the_least_needed(errors):
    text = _on_every_rank(errors, "memory budget below any plan")
    assert "even the plan with the least memory needs" in text and "over the budget" in text


def test_plan_file_for_another_model_says_so(errors):
    text = _on_every_rank(errors, "plan for another model")
    assert text.count("the plan was made for a different graph") == 2


def test_plan_file_for_another_world_size_names_both_sizes(errors):
    text = _on_every_rank(errors, "plan for another world size")
    assert text.count("made for world size 3, but the world size is 2") == 2


def test_pins_naming_no_module_fail_on_every_rank(errors):
    text = _on_every_rank(errors, "pins naming no module")
    assert text.count("'classifier'") == 2


def test_global_batch_smaller_than_world_size_asks_for_a_larger_batch(errors):
    text = _on_every_rank(errors, "global batch below world size")
    assert text.count("the global batch has 1 samples ([1, 0] per rank), fewer than the 2 devices") == 2


def test_training_step_that_skips_forward_fails_at_the_first_step(errors):
    text = _on_every_rank(errors, "training_step without forward")
    assert text.count("did not call NoForwardMLP.forward") == 2
    assert text.count("DeepPoolStrategy(module='<name>')") == 2


def test_a_forward_that_mixes_samples_is_refused_on_every_rank(errors):
    text = _on_every_rank(errors, "mixes samples")
    assert text.count("mixes samples") == 2


def test_shapes_differing_between_ranks_under_a_loss_in_forward_fail_on_every_rank(errors):
    text = _on_every_rank(errors, "one rank's shape changes, loss in forward")
    assert text.count("the ranks' batches have different per-sample shapes") == 2
    assert text.count("reduces over each rank's samples") == 2


def test_sparse_gradients_are_refused_on_every_rank_naming_the_embeddings(errors):
    text = _on_every_rank(errors, "sparse gradients")
    assert text.count("['users', 'items'] produce sparse gradients") == 2


def test_a_non_tensor_argument_one_rank_changes_fails_every_rank(errors):
    text = _on_every_rank(errors, "one rank's arguments change")
    assert text.count("ranks called the planned forward with different arguments") == 2
    assert (
        "1.0" in errors[0]["one rank's arguments change"]
        and "2.0" in errors[1]["one rank's arguments change"]
    )


def test_a_shared_batch_one_rank_read_flipped_fails_on_every_rank(errors):
    assert _on_every_rank(errors, "shared batch differs").count("the ranks' batches differ") == 2


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"amplification_limit": 0.5}, "amplification_limit must be >= 1"),
        ({"check_every_n_steps": -1}, "check_every_n_steps must be >= 0"),
        ({"plan": 3}, "plan must be None, a plan file path or a mapping of pins"),
        ({"compile_layers": "inductor"}, "compile_layers must be True, False or a mapping"),
    ],
)
def test_bad_strategy_arguments_are_refused_when_the_strategy_is_made(arguments, error):
    with pytest.raises((TypeError, ValueError), match=error):
        DeepPoolStrategy(**arguments)
