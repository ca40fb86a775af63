"""A data-parallel plan (every layer at full width) runs as DDP does once installed: the module's own
forward on each rank's samples, no call agreement (the ranks meet only where steps end and before
collectives), gradient buckets launched by the backward's hooks."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_deeppool import DeepPoolStrategy
from lightning_deeppool.comm.messages import GroupMessages
from lightning_deeppool.lowering.schedule import Bucket
from lightning_deeppool.runtime.grad_sync import GradSync
from lightning_deeppool.session.call_agreement import CallAgreement

from distributed import run_distributed
from models import (
    TALL,
    Batches,
    images,
    join_lightning_world,
    make_model,
    max_param_diff,
    parameters,
    trainer_kwargs,
)


def _counted(method: Any, counts: dict[str, int]) -> Any:
    def counting(self: CallAgreement, *args: Any, **kwargs: Any) -> Any:
        counts[method.__name__] += 1
        return method(self, *args, **kwargs)

    return counting


def _fit(rank: int, root: str, batches: list[Any], shapes_differ: bool = False) -> dict[str, Any]:
    """Meetings in the call agreement and the parameters, after a fit under a data-parallel plan; with
    `shapes_differ`, rank 1 reads every batch at the other per-sample shape (the same values)."""
    join_lightning_world(rank, 2)
    if shapes_differ and rank == 1:
        batches = [
            (x.reshape(8, 3, 4, 16) if x.shape[-1] == 8 else x.reshape(8, 3, 8, 8), y) for x, y in batches
        ]
    counts = {"agree": 0, "begin_step": 0}
    for name in counts:
        setattr(CallAgreement, name, _counted(getattr(CallAgreement, name), counts))
    model = make_model("mlp")
    strategy = DeepPoolStrategy(plan={"": 2}, cache_dir=False, profile_warmup=0, profile_repeats=1)
    trainer = pl.Trainer(
        **trainer_kwargs(devices=2, strategy=strategy, default_root_dir=root, max_steps=len(batches))
    )
    trainer.fit(model, DataLoader(Batches(batches), batch_size=None))
    return {"counts": counts, "params": parameters(model)}


def _batches() -> list[Any]:
    """Every rank reads these; the second has another per-sample shape, which the MLP accepts (it
    flattens) but a captured graph, specialized to the first, would not."""
    x, y = images(8).tensors
    return [(x, y), (x.reshape(8, 3, 4, 16), y)] * 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    return run_distributed(_fit, 2, str(tmp_path_factory.mktemp("data_parallel")), _batches())


@pytest.fixture(scope="module")
def ranks_of_other_shapes(tmp_path_factory) -> list[dict[str, Any]]:
    return run_distributed(_fit, 2, str(tmp_path_factory.mktemp("data_parallel")), _batches(), True)


def test_a_data_parallel_plan_agrees_on_no_call_but_the_one_that_installs_it(ranks):
    # Its ranks still meet where each step ends (and before collectives): begin_step every step.
    for result in ranks:
        assert result["counts"] == {"agree": 1, "begin_step": len(_batches())}


def _one_device() -> dict[str, torch.Tensor]:
    reference = make_model("mlp")
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for inputs, labels in _batches():  # both ranks read the same batch: the global mean is that batch's
        optimizer.zero_grad()
        F.cross_entropy(reference(inputs), labels).backward()
        optimizer.step()
    return parameters(reference)


def test_a_data_parallel_plan_trains_batches_of_another_per_sample_shape_as_one_device(ranks):
    assert max_param_diff(_one_device(), ranks[0]["params"]) < 1e-5
    assert max_param_diff(ranks[0]["params"], ranks[1]["params"]) == 0


def test_a_data_parallel_plan_trains_ranks_whose_batches_differ_in_shape_from_the_first_step(
    ranks_of_other_shapes,
):
    assert max_param_diff(_one_device(), ranks_of_other_shapes[0]["params"]) < 1e-5
    assert max_param_diff(ranks_of_other_shapes[0]["params"], ranks_of_other_shapes[1]["params"]) == 0


def _validate_batch_norm(rank: int, root: str) -> dict[str, Any]:
    """The BatchNorm model validated after each of two epochs, under Lightning's DDP and under a
    data-parallel plan: per strategy the logged val_loss and the final buffers."""
    join_lightning_world(rank, 2)
    data = images(16, size=TALL)
    found = {}
    for name in ("ddp", "deeppool"):
        model = make_model("spatial")
        strategy: Any = (
            "ddp" if name == "ddp" else DeepPoolStrategy(plan={"": 2}, cache_dir=False, profile_warmup=0)
        )
        trainer = pl.Trainer(
            **trainer_kwargs(devices=2, strategy=strategy, default_root_dir=root, max_epochs=2)
        )
        trainer.fit(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
        found[name] = {
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "buffers": {k: b.clone() for k, b in model.named_buffers()},
        }
    return found


def test_a_data_parallel_plan_validates_and_ends_with_rank_zeros_batch_norm_statistics_as_ddp(tmp_path):
    ranks = run_distributed(_validate_batch_norm, 2, str(tmp_path), timeout_s=300)
    ddp = ranks[0]["ddp"]
    for rank in ranks:
        assert abs(rank["deeppool"]["val_loss"] - ddp["val_loss"]) < 1e-6
        assert max_param_diff(ddp["buffers"], rank["deeppool"]["buffers"]) < 1e-6


def _tied_sync(once: bool) -> tuple[set[str], torch.Tensor, torch.Tensor]:
    """A parameter used by two layers of one graph: what is still fresh after an armed backward, its
    synchronized gradient and the plain one."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(4, 4))
    grad_sync = GradSync(
        {"weight": weight}, GroupMessages(), 1, [Bucket(0, (0,), ("weight",))], uses={"weight": 2}
    )
    x = torch.randn(3, 4)
    grad_sync.arm(True, once=once)
    with grad_sync.in_stage():
        ((x @ weight) @ weight).sum().backward()
    fresh = grad_sync.fresh()
    grad_sync.sync()
    synced = weight.grad.clone()
    weight.grad = None
    ((x @ weight) @ weight).sum().backward()
    return fresh, synced, weight.grad


def test_one_graph_backward_launches_a_shared_parameter_bucket_from_its_hook():
    fresh, synced, plain = _tied_sync(once=True)
    assert fresh == set()
    assert torch.equal(synced, plain)


def test_a_staged_backward_waits_for_the_schedule_to_launch_a_shared_parameter():
    fresh, synced, plain = _tied_sync(once=False)
    assert fresh == {"weight"}
    assert torch.equal(synced, plain)
