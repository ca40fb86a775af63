"""Spatial splits: the halo geometry, and convolutions and pooling on parts of a sample's height that
give one device's values and gradients, and BatchNorm over every part's rows (spawned gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from lightning_deeppool.ir.rows import (
    Boundary,
    OwnRows,
    RowMove,
    Slab,
    Window,
    halo_moves,
    own_rows,
    row_parts,
    slab,
)
from lightning_deeppool.spatial.batch_norm import split_batch_norm
from lightning_deeppool.spatial.halo import Kernel, windowed
from lightning_deeppool.spatial.layer import Convolution, MaxPooling
from lightning_deeppool.spatial.part import SpatialPart

from distributed import run_distributed

THREE = Window(kernel=3, padding=1)


@pytest.mark.parametrize(
    ("window", "size"),
    [(THREE, 10), (Window(3, 2, 1), 11), (Window(5, 1, 4, 2), 9), (Window(7, 2, 3), 224), (Window(2, 2), 7)],
)
def test_output_size_is_torchs(window: Window, size: int) -> None:
    x = torch.zeros(1, 1, size, 1)
    weight = torch.zeros(1, 1, window.kernel, 1)
    y = F.conv2d(
        x, weight, stride=(window.stride, 1), padding=(window.padding, 0), dilation=(window.dilation, 1)
    )
    assert window.output_size(size) == y.shape[2]


def test_rows_split_evenly_with_earlier_parts_taking_the_remainder() -> None:
    assert row_parts(10, 3) == (4, 3, 3)
    assert row_parts(2, 4) == (1, 1, 0, 0)


def test_a_three_by_three_convolution_needs_one_row_from_each_neighbour() -> None:
    assert [slab(THREE, 10, 3, i) for i in range(3)] == [
        Slab(0, 5, 1, 0),
        Slab(3, 8, 0, 0),
        Slab(6, 10, 0, 1),
    ]
    assert halo_moves(THREE, 10, 3) == [
        RowMove(0, 1, 3, 1),
        RowMove(1, 0, 4, 1),
        RowMove(1, 2, 6, 1),
        RowMove(2, 1, 7, 1),
    ]


def test_a_stride_two_convolution_reads_only_the_rows_its_outputs_need() -> None:
    # 11 rows -> 6 outputs, 3 per part; part 1's outputs 3..5 read rows 5..11 (11 is padding).
    window = Window(kernel=3, stride=2, padding=1)
    assert slab(window, 11, 2, 1) == Slab(5, 11, 0, 1)
    assert halo_moves(window, 11, 2) == [RowMove(0, 1, 5, 1)]


def test_a_pointwise_operation_moves_nothing() -> None:
    assert halo_moves(Window(), 9, 4) == []


def test_a_part_without_output_rows_needs_no_slab() -> None:
    assert slab(THREE, 2, 3, 2) == Slab(0, 0, 0, 0)


def test_a_three_by_three_convolution_runs_on_the_own_rows_and_recomputes_one_row_per_neighbour() -> None:
    # 10 rows in 3 parts (4, 3, 3): each part pads its own rows by one; the rows next to a neighbour
    # read one halo row and are computed again from the three rows they read.
    assert [own_rows(THREE, 10, 3, i) for i in range(3)] == [
        OwnRows(0, 4, 1, (Boundary(3, 4, 2, 5),)),
        OwnRows(4, 7, 1, (Boundary(0, 1, 3, 6), Boundary(2, 3, 5, 8))),
        OwnRows(7, 10, 1, (Boundary(0, 1, 6, 9),)),
    ]


def test_a_stride_two_convolution_pads_its_own_rows_as_the_whole_sample_is_padded() -> None:
    window = Window(kernel=3, stride=2, padding=1)
    # 512 rows in 2: part 1's outputs 128..255 read rows 255..511; its last window needs no padding.
    assert own_rows(window, 512, 2, 1) == OwnRows(256, 512, 1, (Boundary(0, 1, 255, 258),))
    assert own_rows(window, 512, 2, 0) == OwnRows(0, 256, 1, ())


def test_parts_whose_windows_padding_cannot_align_or_whose_rows_all_read_a_halo_use_the_slab() -> None:
    # 13 rows in 4, stride 2: part 2's outputs 4..5 read rows 7..11 with no row of padding above its
    # own rows but two below; part 1's two outputs each read a halo.
    window = Window(kernel=3, stride=2, padding=1)
    assert [own_rows(window, 13, 4, i) is None for i in range(4)] == [False, True, True, True]
    assert own_rows(Window(kernel=5, padding=4, dilation=2), 11, 3, 1) is None


def test_an_invalid_window_is_refused() -> None:
    with pytest.raises(ValueError, match="not a valid window"):
        Window(kernel=0)


# --------------------------------------------------------------------------------- exchange
def _split_conv(
    rank: int, window: Window, height: int, groups: int, pool: bool
) -> tuple[float, float, float]:
    """Each rank holds its rows of the input's height; it convolves (or max-pools) them with the halo
    from its neighbours, and backpropagates a fixed weighting of its output rows. Returns the largest
    differences from one device: output rows, input-gradient rows and the summed weight gradient."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(2, 4, height, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 4 // groups, window.kernel, 3, dtype=torch.float64, requires_grad=True)

    def op(t: torch.Tensor, pad: int) -> torch.Tensor:
        hw = {"stride": (window.stride, 1), "dilation": (window.dilation, 1)}
        if pool:
            return F.max_pool2d(t, (window.kernel, 3), padding=(pad, 1), **hw)  # type: ignore[arg-type]
        return F.conv2d(t, weight, padding=(pad, 1), groups=groups, **hw)  # type: ignore[arg-type]

    kernel: Kernel
    if pool:
        kernel = MaxPooling(window, [window.kernel, 3], [window.stride, 1], [0, 1], [window.dilation, 1])
    else:
        kernel = Convolution(
            torch.ops.aten.conv2d.default, window, [window.stride, 1], [0, 1], [window.dilation, 1], groups
        )

    full = op(x, window.padding)
    weighting = torch.randn(full.shape, dtype=torch.float64)
    (full * weighting).sum().backward()
    reference_x = x.grad.clone()  # type: ignore[union-attr]
    reference_w = weight.grad.clone() if weight.grad is not None else torch.zeros_like(weight)
    x.grad, weight.grad = None, None

    rows, out_rows = row_parts(height, world), row_parts(window.output_size(height), world)
    start, out_start = sum(rows[:rank]), sum(out_rows[:rank])
    local = x.detach()[:, :, start : start + rows[rank]].requires_grad_()
    params = () if pool else (weight, None)
    out = windowed(local, kernel, params, dim=2, size=height, part=SpatialPart(tuple(range(world)), rank))
    expected = full.detach()[:, :, out_start : out_start + out_rows[rank]]
    (out * weighting[:, :, out_start : out_start + out_rows[rank]]).sum().backward()
    grad_w = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    dist.all_reduce(grad_w)
    return (
        (out - expected).abs().max().item(),
        (local.grad - reference_x[:, :, start : start + rows[rank]]).abs().max().item(),  # type: ignore[operator]
        (grad_w - reference_w).abs().max().item(),
    )


# Per world size (one spawn each): (name, window, height, groups, max pooling).
SPLITS = {
    2: [
        ("3x3", THREE, 10, 1, False),
        ("max pooling pads with -inf", Window(kernel=3, stride=2, padding=1), 9, 1, True),
    ],
    3: [
        ("uneven: 4, 3, 3 rows", THREE, 10, 1, False),
        ("halos of 4 rows, dilated", Window(kernel=5, padding=4, dilation=2), 11, 1, False),
    ],
    4: [
        ("stride 2, grouped", Window(kernel=3, stride=2, padding=1), 13, 2, False),
        ("halos that span two parts", Window(kernel=7, stride=2, padding=3), 9, 1, False),
    ],
}


def _splits(rank: int, cases: list[tuple]) -> dict[str, float]:
    return {name: max(_split_conv(rank, *case)) for name, *case in cases}


@pytest.mark.parametrize("world", sorted(SPLITS))
def test_split_height_gives_one_devices_outputs_and_gradients(world: int) -> None:
    for differences in run_distributed(_splits, world, SPLITS[world]):
        assert all(d < 1e-12 for d in differences.values()), differences


def _split_batch_norm(rank: int, height: int) -> tuple[float, float, float, float]:
    """Each rank normalizes its rows of the samples' height. Returns the largest differences from one
    device: output rows, input-gradient rows, summed weight and bias gradients, running statistics."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(3, 4, height, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True)
    running = (torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
    full = F.batch_norm(x, *running, weight, bias, True, 0.1, 1e-5)
    weighting = torch.randn(full.shape, dtype=torch.float64)
    (full * weighting).sum().backward()
    reference = (x.grad.clone(), weight.grad.clone(), bias.grad.clone())  # type: ignore[union-attr]
    weight.grad, bias.grad = None, None

    rows = row_parts(height, world)
    start = sum(rows[:rank])
    local = x.detach()[:, :, start : start + rows[rank]].requires_grad_()
    mine = (torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
    out = split_batch_norm(
        local,
        *mine,
        weight,
        bias,
        training=True,
        momentum=0.1,
        eps=1e-5,
        dim=2,
        size=height,
        part=SpatialPart(tuple(range(world)), rank),
    )
    (out * weighting[:, :, start : start + rows[rank]]).sum().backward()
    params = torch.cat([weight.grad, bias.grad])  # type: ignore[list-item]
    dist.all_reduce(params)
    return (
        (out - full.detach()[:, :, start : start + rows[rank]]).abs().max().item(),
        (local.grad - reference[0][:, :, start : start + rows[rank]]).abs().max().item(),  # type: ignore[operator]
        (params - torch.cat(reference[1:])).abs().max().item(),
        max((a - b).abs().max().item() for a, b in zip(mine, running)),
    )


@pytest.mark.parametrize(("world", "height"), [(2, 8), (3, 7)])
def test_split_batch_norm_gives_one_devices_outputs_gradients_and_running_statistics(world, height) -> None:
    for differences in run_distributed(_split_batch_norm, world, height):
        assert max(differences) < 1e-12
