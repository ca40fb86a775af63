"""The Fabric front door: a hand-written Fabric loop under `DeepPoolStrategy` trains to one device's
weights (2 and 3 ranks, mixed widths, and the automatic plan), with accumulation under
`no_backward_sync`, gradient clipping, an all-reduced validation metric, and checkpoints that load on
every rank mid-run and into plain Fabric on one device."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_deeppool.fabric import DeepPoolStrategy

from distributed import run_distributed
from models import join_lightning_world, max_param_diff, parameters

pytestmark = pytest.mark.floors

SEED = 7
PER_RANK = 4  # samples per rank and micro-batch
STEPS = 4
MAX_NORM = 0.3  # small enough that every step clips (asserted)


class Net(nn.Module):
    """A trunk the pins keep wide and a parameter-heavy head they narrow."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


class ConvNet(nn.Module):
    """Convolutions (a pin splits the second by height), then the head: 12 features as a 1x3x4 image."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 2, 3, padding=1))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(24, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x.view(-1, 1, 3, 4)))


def _data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(samples, 12, generator=generator), torch.randint(0, 5, (samples,), generator=generator)
    )


def _fabric(strategy: Any, devices: int) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    return fabric


def _strategy(plan: Any) -> Any:
    if plan == "deeppool":
        return "deeppool"
    return DeepPoolStrategy(plan=plan, cache_dir=False, profile_warmup=0, profile_repeats=1)


def _train(
    fabric: Fabric, model: Any, optimizer: Any, loader: Iterable[Any], steps: int, accumulate: int
) -> list[float]:
    """The loop: `accumulate` micro-batches a step (all but the last under no_backward_sync), clipped
    by norm; returns the norm clipping saw at each step."""
    norms = []
    batches = iter(loader)
    for _ in range(steps):
        for micro in range(accumulate):
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                fabric.backward(F.cross_entropy(model(x), y) / accumulate)
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def _validate(fabric: Fabric, model: Any, loader: DataLoader) -> float:
    """The summed validation loss, all-reduced, in eval mode without gradients."""
    model.eval()
    total = torch.zeros(())
    with torch.no_grad():
        for x, y in loader:
            total += F.cross_entropy(model(x), y, reduction="sum")
    model.train()
    return float(fabric.all_reduce(total, reduce_op="sum"))


def _session(fabric: Fabric, world: int, accumulate: int, make: Any, compiled: bool) -> dict[str, Any]:
    """Set up and train the net `make` builds (compiled by `torch.compile` where asked), then validate:
    every rank's view of the outcome."""
    steps = STEPS
    torch.manual_seed(SEED)
    net = make()
    given = torch.compile(net, backend="eager") if compiled else net
    model, optimizer = fabric.setup(given, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    train = DataLoader(_data(PER_RANK * world * accumulate * steps, 1), batch_size=PER_RANK)
    val = DataLoader(_data(6 * world, 2), batch_size=3)
    train, val = fabric.setup_dataloaders(train, val, use_distributed_sampler=world > 1)
    norms = _train(fabric, model, optimizer, train, steps, accumulate)
    fabric.barrier()
    collectives = {
        "gathered": fabric.all_gather(torch.tensor(fabric.global_rank)).tolist(),
        "broadcast": fabric.broadcast(fabric.global_rank, src=world - 1),
    }
    val_loss = _validate(fabric, model, val)
    return {"params": parameters(net), "norms": norms, "val_loss": val_loss, **collectives}


def _one_device(world: int, accumulate: int, make: Any = Net) -> dict[str, Any]:
    """The same loop on one device, reading each step's global batch (every rank's samples)."""
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(SEED)
    net = make()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    train = _global_batches(_data(PER_RANK * world * accumulate * STEPS, 1), world)
    val = DataLoader(_data(6 * world, 2), batch_size=3)
    norms = _train(fabric, model, optimizer, train, STEPS, accumulate)
    return {"params": parameters(net), "norms": norms, "val_loss": _validate(fabric, model, val)}


def _global_batches(dataset: TensorDataset, world: int) -> DataLoader:
    """Fabric's DistributedSampler (no shuffling) gives rank r samples r, r + world, ...: its i-th
    batch of every rank together is the block of samples i * PER_RANK * world onwards."""
    return DataLoader(dataset, batch_size=PER_RANK * world)


def _distributed(
    rank: int, world: int, plan: Any, accumulate: int, make: Any = Net, compiled: bool = False
) -> dict[str, Any]:
    join_lightning_world(rank, world)
    fabric = _fabric(_strategy(plan), world)
    outcome = _session(fabric, world, accumulate, make, compiled)
    strategy = fabric.strategy
    assert isinstance(strategy, DeepPoolStrategy)
    assert strategy.plan is not None
    placements = strategy.plan.placements().values()
    outcome["widths"] = sorted({p.width for p in placements})
    outcome["spatial"] = max(p.spatial for p in placements)
    return outcome


@pytest.mark.parametrize(
    ("world", "plan", "accumulate"),
    [
        (2, {"": 2, "head": 1}, 1),
        (2, {"": 2, "head": 1}, 2),
        (3, {"": 3, "head": 1}, 1),
        (3, {"": 3, "trunk.2": 2, "head": 1}, 2),
    ],
)
def test_a_fabric_loop_trains_to_one_devices_weights(world: int, plan: Any, accumulate: int) -> None:
    expected = _one_device(world, accumulate)
    outcomes = run_distributed(_distributed, world, world, plan, accumulate, timeout_s=180)
    assert min(expected["norms"]) > MAX_NORM  # every step clipped
    assert outcomes[0]["widths"][0] == 1  # the head ran narrow
    assert max_param_diff(outcomes[0]["params"], expected["params"]) < 1e-5
    for outcome in outcomes:
        assert outcome["norms"] == pytest.approx(expected["norms"], rel=1e-5)
        assert outcome["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
        assert max_param_diff(outcome["params"], expected["params"]) < 1e-5  # refreshed by model.eval()
        assert outcome["gathered"] == list(range(world))
        assert outcome["broadcast"] == world - 1


def test_strategy_deeppool_plans_automatically_and_trains_to_one_devices_weights() -> None:
    expected = _one_device(2, 1)
    outcomes = run_distributed(_distributed, 2, 2, "deeppool", 1, timeout_s=180)
    for outcome in outcomes:
        assert max_param_diff(outcome["params"], expected["params"]) < 1e-5
        assert outcome["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)


def test_a_spatial_split_pinned_in_a_fabric_loop_trains_to_one_devices_weights() -> None:
    plan = {"": 2, "body.2": {"width": 2, "spatial": 2}, "head": 1}
    expected = _one_device(2, 1, ConvNet)
    outcomes = run_distributed(_distributed, 2, 2, plan, 1, ConvNet, timeout_s=180)
    assert outcomes[0]["spatial"] == 2
    for outcome in outcomes:
        assert max_param_diff(outcome["params"], expected["params"]) < 1e-5
        assert outcome["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)


def test_a_module_given_to_setup_compiled_trains_its_plan_to_one_devices_weights() -> None:
    expected = _one_device(2, 1)
    outcomes = run_distributed(_distributed, 2, 2, {"": 2, "head": 1}, 1, Net, True, timeout_s=180)
    assert outcomes[0]["widths"] == [1, 2]
    for outcome in outcomes:
        assert max_param_diff(outcome["params"], expected["params"]) < 1e-5


def _evaluates_without_eval(rank: int, world: int) -> None:
    join_lightning_world(rank, world)
    fabric = _fabric(_strategy({"": world, "head": 1}), world)
    torch.manual_seed(SEED)
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(DataLoader(_data(PER_RANK * world * 2, 1), batch_size=PER_RANK))
    _train(fabric, model, optimizer, loader, 2, 1)
    with torch.no_grad():  # no model.eval(): rank 1's head is stale
        loss = F.cross_entropy(model(torch.randn(3, 12)), torch.zeros(3, dtype=torch.long))
    fabric.all_reduce(loss)


def test_evaluating_stale_weights_without_model_eval_stops_every_rank_naming_the_refresh() -> None:
    with pytest.raises(
        RuntimeError, match=r"(?s)rank 1 raised.*out of date until the next refresh.*model\.eval\(\)"
    ):
        run_distributed(_evaluates_without_eval, 2, 2, timeout_s=120)


def test_importing_the_package_registers_deeppool_in_fabrics_registry() -> None:
    assert STRATEGY_REGISTRY["deeppool"]["strategy"] is DeepPoolStrategy
    assert STRATEGY_REGISTRY["deeppool_spawn"]["init_params"] == {"start_method": "spawn"}


def _round_trip(rank: int, world: int, path: str) -> dict[str, Any]:
    """Train 2 steps, save, train 2 more; load the checkpoint on every rank and train those 2 again."""
    join_lightning_world(rank, world)
    fabric = _fabric(_strategy({"": world, "head": 1}), world)
    torch.manual_seed(SEED)
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    loader = fabric.setup_dataloaders(DataLoader(_data(PER_RANK * world * 4, 1), batch_size=PER_RANK))
    batches = list(loader)
    _train(fabric, model, optimizer, batches[:2], 2, 1)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    _train(fabric, model, optimizer, batches[2:], 2, 1)
    first = parameters(net)
    state = {"model": model, "optimizer": optimizer}
    remainder = fabric.load(path, state)
    loaded = parameters(net)
    _train(fabric, model, optimizer, batches[2:], 2, 1)
    return {"first": first, "again": parameters(net), "loaded": loaded, "remainder": remainder}


def test_a_checkpoint_saved_mid_run_loads_on_every_rank_and_trains_the_same_steps_again(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "mid.ckpt")
    outcomes = run_distributed(_round_trip, 2, 2, path, timeout_s=180)
    assert outcomes[0]["remainder"] == {"step": 2}
    assert max_param_diff(outcomes[0]["loaded"], outcomes[1]["loaded"]) == 0.0  # rank 1's whole again
    assert max_param_diff(outcomes[0]["again"], outcomes[0]["first"]) < 1e-6
    # ... and plain Fabric on one device resumes it to the same weights
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(SEED)
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    fabric.load(path, {"model": model, "optimizer": optimizer})
    global_batches = list(_global_batches(_data(PER_RANK * 2 * 4, 1), 2))
    _train(fabric, model, optimizer, global_batches[2:], 2, 1)
    assert max_param_diff(parameters(net), outcomes[0]["first"]) < 1e-5


def _second_module(rank: int, world: int) -> None:
    join_lightning_world(rank, world)
    fabric = _fabric(_strategy({"": world}), world)
    fabric.setup(Net())
    fabric.setup(Net())


def test_a_second_module_is_refused_on_every_rank() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)rank 0 raised.*plans one module.*rank 1 raised.*plans one"):
        run_distributed(_second_module, 2, 2)
