"""Captured layers run on parts of spatially split samples give one device's values, gradients and
BatchNorm statistics on 2, 3 and 4 spawned gloo ranks (2-d, 1-d and 3-d convolutions, max pooling in
ceil mode, uneven splits), and operations that are not spatially local are refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_deeppool.capture import capture_graph
from lightning_deeppool.spatial.layer import run_layer_split
from lightning_deeppool.spatial.part import SpatialPart

from distributed import run_distributed


class Residual(nn.Module):
    """Convolution, BatchNorm and ReLU with a skip: an add of two split values."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn(self.conv(x)))


def conv_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2),
        Residual(8),
    )


def sequence_net() -> nn.Module:
    """1-d convolutions (a kernel of 5, a stride of 2) and BatchNorm, split along the length."""
    return nn.Sequential(
        nn.Conv1d(3, 4, 5, padding=2), nn.ReLU(), nn.Conv1d(4, 4, 3, stride=2, padding=1), nn.BatchNorm1d(4)
    )


def volume_net() -> nn.Module:
    """A 3-d convolution, BatchNorm and a ceil-mode max pooling, split along the depth."""
    return nn.Sequential(nn.Conv3d(3, 4, 3, padding=1), nn.BatchNorm3d(4), nn.MaxPool3d(2, ceil_mode=True))


def ceil_pooling_net() -> nn.Module:
    """A max pooling whose last window hangs over the input (ceil mode), with a halo row."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(3, 2, padding=1, ceil_mode=True))


# (model, input shape per sample); every split dimension is uneven over 2, 3 and 4 parts.
MODELS = {
    "2-d conv net": (conv_net, (3, 18, 6)),
    "1-d": (sequence_net, (3, 33)),
    "3-d, ceil mode": (volume_net, (3, 9, 4, 3)),
    "2-d ceil mode": (ceil_pooling_net, (3, 11, 5)),
}


def _all_split(rank: int) -> dict[str, tuple[float, float, float, float]]:
    return {name: _layers_split(rank, make, shape) for name, (make, shape) in MODELS.items()}


def _layers_split(
    rank: int, make: Callable[[], nn.Module], shape: tuple[int, ...]
) -> tuple[float, float, float, float]:
    """Run every layer of the captured net on this rank's rows of the input's first spatial
    dimension. Returns the largest differences from one device: output rows, input-gradient rows,
    summed parameter gradients, BatchNorm running statistics."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    net = make().double()
    x = torch.randn(2, *shape, dtype=torch.float64, requires_grad=True)
    height = shape[1]
    captured = capture_graph(net, (x.detach(),))
    buffers = {k: v.clone() for k, v in net.state_dict().items()}
    input_name = captured.batch_inputs[0]

    full = captured.run_all({input_name: x}, 2, {})[captured.graph.layers[-1].name][0]
    weighting = torch.randn(full.shape, dtype=torch.float64)
    (full * weighting).sum().backward()
    reference_x = x.grad.clone()  # type: ignore[union-attr]
    reference_params = {k: p.grad.clone() for k, p in net.named_parameters()}  # type: ignore[union-attr]
    reference_buffers = {k: v.clone() for k, v in net.state_dict().items() if "running" in k}
    net.load_state_dict(buffers)
    net.zero_grad(set_to_none=True)

    part = SpatialPart(ranks=tuple(range(world)), index=rank)
    start, stop = part.rows(height)
    local = x.detach()[:, :, start:stop].requires_grad_()
    values: dict[str, object] = {input_name: local}
    sizes = {input_name: height}
    for layer in captured.graph.layers:
        values[layer.name], outputs = run_layer_split(captured, layer.name, values, 2, {}, part, sizes)
        sizes.update(outputs)
    out = values[captured.graph.layers[-1].name][0]  # type: ignore[index]
    out_start, out_stop = part.rows(full.shape[2])
    (out * weighting[:, :, out_start:out_stop]).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in net.parameters()])  # type: ignore[union-attr]
    dist.all_reduce(grads)
    return (
        (out - full.detach()[:, :, out_start:out_stop]).abs().max().item(),
        (local.grad - reference_x[:, :, start:stop]).abs().max().item(),  # type: ignore[operator]
        (grads - torch.cat([g.flatten() for g in reference_params.values()])).abs().max().item(),
        max(
            ((net.state_dict()[k] - v).abs().max().item() for k, v in reference_buffers.items()), default=0.0
        ),
    )


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("model", list(MODELS))
def test_split_layers_give_one_devices_values_and_gradients(world: int, model: str, split_runs) -> None:
    for differences in split_runs(world):
        assert max(differences[model]) < 1e-10, (model, differences[model])


@pytest.fixture(scope="module")
def split_runs():
    """Every model on each number of ranks, one spawn per number (spawning takes the time)."""
    runs: dict[int, list] = {}

    def run(world: int) -> list:
        if world not in runs:
            runs[world] = run_distributed(_all_split, world)
        return runs[world]

    return run


def test_an_operation_that_is_not_spatially_local_is_refused_with_its_name() -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 8 * 8, 2))
    x = torch.randn(2, 3, 8, 8)
    captured = capture_graph(net, (x,), granularity="module")
    input_name = captured.batch_inputs[0]
    values = {input_name: x}
    sizes = {input_name: 8}
    part = SpatialPart(ranks=(0,), index=0)
    first, flatten = captured.graph.layers[:2]
    values[first.name], outputs = run_layer_split(captured, first.name, values, 2, {}, part, sizes)
    sizes.update(outputs)
    with pytest.raises(ValueError, match=r"aten.flatten.* is not spatially local.* Plan this layer"):
        run_layer_split(captured, flatten.name, values, 2, {}, part, sizes)
