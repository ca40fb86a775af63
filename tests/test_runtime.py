"""The raw burst runtime (no Lightning): outputs and owned gradients equal single-process ones for
mixed widths, layers on ranks without rank 0, uneven local sample counts, on 2 and 3 ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_deeppool.capture import capture_graph
from lightning_deeppool.capture.graph import value_meta
from lightning_deeppool.comm.groups import PlanGroups
from lightning_deeppool.comm.messages import GroupMessages
from lightning_deeppool.ir.placement import Placement
from lightning_deeppool.lowering.schedule import build_schedule
from lightning_deeppool.runtime.grad_sync import GradSync
from lightning_deeppool.runtime.runtime import BurstRuntime, check_break_output

from distributed import run_distributed

SAMPLES = 12
WIDTH_PATTERNS = {
    "mixed": lambda i, world: [world, 1, 2, world, 1, 1, 1, 2][i % 8],
    "all-one": lambda i, world: 1,
    "all-world": lambda i, world: world,
    # Layers on ranks that leave rank 0 out: their gradients reach rank 0 after the sum.
    "off rank zero": lambda i, world: [
        Placement(world),
        Placement(1, 1, world - 1),
        Placement(world - 1, 1, 1),
        Placement(1, 1, 1),
    ][i % 4],
}
COUNTS = {2: (5, 7), 3: (4, 1, 7)}


class Net(nn.Module):
    """Convolutions with a residual add and a concatenation, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.c1(x))
        z = torch.cat([self.c2(y) + y, y], 1)
        return self.fc(z.view(z.size(0), -1))


def _errors(rank: int, world: int) -> dict[str, dict[str, float]]:
    """Per width pattern: max |difference| of the outputs and of every gradient this rank owns."""
    torch.manual_seed(0)
    x, y = torch.randn(SAMPLES, 3, 8, 8), torch.randint(0, 10, (SAMPLES,))
    counts = COUNTS[world]
    lo = sum(counts[:rank])
    mine = slice(lo, lo + counts[rank])
    results = {}
    for name, pattern in WIDTH_PATTERNS.items():
        net, ref = Net(), Net()
        ref.load_state_dict(net.state_dict())
        expected = ref(x)
        nn.functional.cross_entropy(expected, y).backward()
        captured = capture_graph(net, (x[:4],))
        widths = {layer.name: pattern(i, world) for i, layer in enumerate(captured.graph.layers)}
        params = dict(captured.module.named_parameters())
        sizes = {k: v.numel() * 4 for k, v in params.items()}
        schedule = build_schedule(captured.graph, widths, captured.layer_params, sizes, world)
        groups = PlanGroups(schedule.param_ranks.values(), world)
        grad_sync = GradSync.for_schedule(
            schedule, params, GroupMessages(groups.redistribution, groups), rank
        )
        runtime = BurstRuntime(captured, schedule, rank=rank, device=torch.device("cpu"), grad_sync=grad_sync)
        out = runtime.forward(x[mine])
        # A rank's loss is its share of the global mean: gradients are divided by the world size.
        (nn.functional.cross_entropy(out, y[mine], reduction="sum") * world / SAMPLES).backward()
        grad_sync.sync()
        errors = {"output": (out - expected[mine]).abs().max().item()}
        reference = dict(ref.named_parameters())
        for param, p in params.items():
            if schedule.owns(rank, param):
                errors[param] = (p.grad - reference[param].grad).abs().max().item()
        with torch.no_grad():
            errors["no-grad output"] = (runtime.forward(x[mine]) - expected[mine]).abs().max().item()
        errors["input-grad"] = _input_grad_error(runtime, ref, params, x[mine], y[mine], world)
        groups.destroy()
        results[name] = errors
    return results


def _input_grad_error(runtime, ref, params, x, y, world) -> float:
    """torch.autograd.grad through the plan gives the input's gradient and leaves `.grad` alone."""
    for p in params.values():
        p.grad = None
    planned, reference = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (got,) = torch.autograd.grad(
        nn.functional.cross_entropy(runtime.forward(planned), y, reduction="sum"), planned
    )
    (want,) = torch.autograd.grad(nn.functional.cross_entropy(ref(reference), y, reduction="sum"), reference)
    untouched = all(p.grad is None for p in params.values())
    return (got - want).abs().max().item() if untouched else float("inf")


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def errors(request) -> tuple[int, list[dict[str, dict[str, float]]]]:
    return request.param, run_distributed(_errors, request.param, request.param)


@pytest.mark.parametrize("pattern", list(WIDTH_PATTERNS))
def test_outputs_match_single_process(errors, pattern):
    _, ranks = errors
    for rank in ranks:
        assert rank[pattern]["output"] < 1e-5
        assert rank[pattern]["no-grad output"] < 1e-5


@pytest.mark.parametrize("pattern", list(WIDTH_PATTERNS))
def test_autograd_grad_reaches_the_inputs_and_leaves_parameter_gradients_alone(errors, pattern):
    _, ranks = errors
    for rank in ranks:
        assert rank[pattern]["input-grad"] < 1e-5


@pytest.mark.parametrize("pattern", list(WIDTH_PATTERNS))
def test_owned_gradients_match_single_process_with_uneven_local_counts(errors, pattern):
    _, ranks = errors
    assert len(ranks[0][pattern]) == 3 + 6  # rank 0 owns all six parameters
    for rank in ranks:
        owned = [v for k, v in rank[pattern].items() if "output" not in k and k != "input-grad"]
        assert max(owned, default=0.0) < 1e-5


def _labels(rank: int) -> dict[str, list[str]]:
    """The runtime's labels among the profiler's events: with a profiler recording a training step, and
    with one started between the forward and its backward; and the schedule's actions."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    captured = capture_graph(Net(), (x,))
    params = dict(captured.module.named_parameters())
    sizes = {k: v.numel() * 4 for k, v in params.items()}
    widths = {layer.name: 1 for layer in captured.graph.layers}
    schedule = build_schedule(captured.graph, widths, captured.layer_params, sizes, 1)
    grad_sync = GradSync.for_schedule(schedule, params, GroupMessages(None), rank)
    runtime = BurstRuntime(captured, schedule, rank=rank, device=torch.device("cpu"), grad_sync=grad_sync)
    with torch.profiler.profile() as recorded:
        runtime.forward(x).sum().backward()
    out = runtime.forward(x)
    with torch.profiler.profile() as later:
        out.sum().backward()

    def labels(profile: torch.profiler.profile) -> list[str]:
        return [e.name for e in profile.events() if e.name.startswith("deeppool:")]

    return {
        "recorded": labels(recorded),
        "later": labels(later),
        "forward": [f"deeppool:{a}" for a in schedule.forward],
        "backward": [f"deeppool:{a}" for a in schedule.backward],
    }


def test_each_action_is_labelled_in_the_profiler_while_one_records():
    [found] = run_distributed(_labels, 1)
    assert found["recorded"] == found["forward"] + found["backward"]
    assert found["later"] == found["backward"]  # the forward ran with no profiler: no labels


def test_a_graph_break_output_whose_per_sample_shape_changed_stops_naming_the_break():
    meta = value_meta(torch.zeros(4, 10, 16), False, [1])
    check_break_output(["encoder"], torch.ones(2, 10, 16), meta)  # fewer samples: the same structure
    with pytest.raises(
        RuntimeError,
        match=r"graph break 'encoder' .* shapes \[\(9, 16\)\] where the capture saw \[\(10, 16\)\]",
    ):
        check_break_output(["encoder"], torch.zeros(4, 9, 16), meta)
