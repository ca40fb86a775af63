"""Capture marks the layers that can split samples by height (`Layer.height`) and what their halos
cost (`Layer.halo_bytes`), from their operations."""

from __future__ import annotations

import torch
from torch import nn

from lightning_deeppool.capture import capture_graph

from models import TALL, SpatialBody


def _layers(net: nn.Module, x: torch.Tensor, **options: object) -> dict[str, tuple[int, int]]:
    captured = capture_graph(net, (x,), **options)  # type: ignore[arg-type]
    return {layer.name: (layer.height, layer.halo_bytes) for layer in captured.graph.layers}


def test_spatially_local_layers_get_their_fewest_rows_and_halo_bytes() -> None:
    layers = _layers(SpatialBody(), torch.randn(2, 3, *TALL))
    height, width = TALL
    # stem: a 3x3 convolution reads one row above and one below: 2 rows of 3 channels.
    assert layers["stem"] == (height, 2 * 3 * width * 4)
    assert layers["norm"] == (height, 0)  # BatchNorm and ReLU read no halo
    # down: a stride-2 3x3 convolution (one halo row of 6 channels), then 2x2 pooling (none); its
    # fewest rows are the pooled output's.
    assert layers["down"] == (height // 4, 1 * 6 * width * 4)
    assert layers["block"] == (height // 4, 2 * 6 * (width // 4) * 4)


def test_layers_with_operations_that_mix_rows_cannot_split() -> None:
    layers = _layers(SpatialBody(), torch.randn(2, 3, *TALL))
    assert layers["head"] == (0, 0)  # flatten, then linear on flat features


def test_an_operation_that_would_make_a_splittable_layer_unsplittable_joins_the_next_layer() -> None:
    layers = _layers(SpatialBody(), torch.randn(2, 3, *TALL))
    assert layers["mix"] == (TALL[0] // 4, 0)  # the 1x1 convolution; its flatten joins the head
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    down = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    assert _layers(nn.Sequential(down, head), torch.randn(2, 3, 16, 16)) == {
        "_0_0": (4, 1 * 3 * 16 * 4),  # the stride-2 convolution's halo row
        "_1_2": (0, 0),  # pooling and flatten with the linear layer
    }


def test_an_operation_between_splittable_layers_that_mixes_rows_is_a_layer_of_its_own() -> None:
    conv = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
    net = nn.Sequential(conv, nn.AvgPool2d(2), nn.Conv2d(4, 4, 3, padding=1))
    assert _layers(net, torch.randn(2, 3, 8, 8)) == {
        "_0_0": (8, 2 * 3 * 8 * 4),
        "_1": (0, 0),
        "_2": (4, 2 * 4 * 4 * 4),
    }


def test_a_one_sample_example_is_captured_by_export_and_splits() -> None:
    layers = _layers(SpatialBody(), torch.randn(1, 3, *TALL))
    assert layers["stem"][0] == TALL[0]


def test_layers_of_a_recorded_forward_do_not_split() -> None:
    net = SpatialBody()
    layers = _layers(net, torch.randn(2, 3, *TALL), leaf_modules=["head"])
    assert all(value == (0, 0) for value in layers.values())


def test_one_and_three_dimensional_layers_split_along_their_first_spatial_dimension() -> None:
    sequence = nn.Sequential(nn.Conv1d(3, 4, 5, padding=2), nn.BatchNorm1d(4))
    assert _layers(sequence, torch.randn(2, 3, 33)) == {"_0": (33, 4 * 3 * 4), "_1": (33, 0)}
    volume = nn.Sequential(nn.Conv3d(3, 4, 3, padding=1), nn.MaxPool3d(2, ceil_mode=True))
    # 9 deep: the ceil-mode pooling keeps a fifth, partial window.
    assert _layers(volume, torch.randn(2, 3, 9, 4, 3)) == {"_0": (5, 2 * 3 * 4 * 3 * 4)}
