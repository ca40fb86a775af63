"""Captured layers run on parts of spatially split samples give one device's values, gradients and
BatchNorm statistics (spawned gloo ranks), and operations that are not spatially local are refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_deeppool.capture import capture_graph
from lightning_deeppool.strategy.spatial_layer import SpatialPart, run_layer_split

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
    ).double()


def _layers_split(rank: int, height: int) -> tuple[float, float, float, float]:
    """Run every layer of the captured net on this rank's rows of the input height. Returns the
    largest differences from one device: output rows, input-gradient rows, summed parameter
    gradients, BatchNorm running statistics."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    net = conv_net()
    x = torch.randn(2, 3, height, 6, dtype=torch.float64, requires_grad=True)
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
        max((net.state_dict()[k] - v).abs().max().item() for k, v in reference_buffers.items()),
    )


@pytest.mark.parametrize(("world", "height"), [(2, 16), (3, 18)])
def test_a_conv_net_split_by_height_gives_one_devices_values_and_gradients(world: int, height: int) -> None:
    for differences in run_distributed(_layers_split, world, height):
        assert max(differences) < 1e-10, differences


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
