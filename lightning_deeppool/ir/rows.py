"""Spatial splits: which rows of a sample each part holds, and which rows a spatially local operation
(convolution, pooling) needs from the neighbouring parts (its halo).

A spatial dimension of `size` rows split in `parts` holds them contiguously and as evenly as possible,
earlier parts taking the remainder (`layout.balanced`, as for samples). An operation's output is split
the same way over its own rows, so every part computes the output rows it holds and reads the input
rows those need: its own, a few of its neighbours' (`halo_moves`), and zeros (or the pooling fill)
where the window hangs over the sample's edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from lightning_deeppool.ir.placement import balanced, offsets

SPLIT_DIM = 2  # the split dimension: the first spatial one of (N, C, L), (N, C, H, W), (N, C, D, H, W)


@dataclass(frozen=True)
class Window:
    """A spatially local operation along one dimension: output row i reads the input rows
    ``i * stride - padding + j * dilation`` for j in 0..kernel-1 (outside 0..size-1: padding).
    `ceil_mode` (pooling) keeps a last, partial window that starts inside the input or its padding."""

    kernel: int = 1
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    ceil_mode: bool = False

    def __post_init__(self) -> None:
        if self.kernel < 1 or self.stride < 1 or self.dilation < 1 or self.padding < 0:
            raise ValueError(f"not a valid window: {self}")

    def output_size(self, size: int) -> int:
        """Output rows for `size` input rows (as `torch.nn.functional.conv2d` and the poolings
        compute them)."""
        span = size + 2 * self.padding - self.extent
        if not self.ceil_mode:
            return max(0, span // self.stride + 1)
        rows = -(-span // self.stride) + 1
        return rows - 1 if (rows - 1) * self.stride >= size + self.padding else rows

    def reads(self, start: int, stop: int) -> tuple[int, int]:
        """The input rows ``[first, last + 1)`` that output rows ``[start, stop)`` read, padding
        included (may reach below 0 or beyond the input)."""
        return start * self.stride - self.padding, (stop - 1) * self.stride - self.padding + self.extent

    @property
    def extent(self) -> int:
        """Input rows one output row reads, first to last."""
        return self.dilation * (self.kernel - 1) + 1


class Slab(NamedTuple):
    """The input a part needs for its output rows: rows ``[start, stop)`` of the sample, with
    `before` and `after` padding rows around them. Empty when the part holds no output rows."""

    start: int
    stop: int
    before: int
    after: int

    @property
    def rows(self) -> int:
        return self.before + (self.stop - self.start) + self.after


def row_parts(size: int, parts: int) -> tuple[int, ...]:
    """Rows each part holds of a dimension of `size` rows split in `parts`."""
    return balanced(size, parts, parts)


def part_rows(size: int, parts: int, index: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` part `index` holds of a dimension of `size` rows."""
    counts = row_parts(size, parts)
    start = offsets(counts)[index]
    return start, start + counts[index]


def slab(window: Window, size: int, parts: int, index: int) -> Slab:
    """The input slab part `index` needs to compute the output rows it holds."""
    start, stop = part_rows(window.output_size(size), parts, index)
    if stop == start:
        return Slab(0, 0, 0, 0)
    first, end = window.reads(start, stop)
    return Slab(max(first, 0), min(end, size), max(0, -first), max(0, end - size))


class RowMove(NamedTuple):
    """`rows` rows of a sample, from row `start` on, move from part `src` to part `dst`."""

    src: int
    dst: int
    start: int
    rows: int


def halo_moves(window: Window, size: int, parts: int) -> list[RowMove]:
    """Input rows that move between parts so each has its slab, sorted by (src, dst). Rows a part
    holds itself do not move."""
    counts = row_parts(size, parts)
    starts = offsets(counts)
    moves = []
    for src in range(parts):
        for dst in range(parts):
            need = slab(window, size, parts, dst)
            lo, hi = max(starts[src], need.start), min(starts[src] + counts[src], need.stop)
            if src != dst and hi > lo:
                moves.append(RowMove(src, dst, lo, hi - lo))
    return moves


class Boundary(NamedTuple):
    """Output rows ``[out_start, out_stop)`` of a part (counted from its first output row) whose
    windows read halo rows; ``[start, stop)`` are all the input rows those windows read: halo, own
    and padding rows."""

    out_start: int
    out_stop: int
    start: int
    stop: int


class OwnRows(NamedTuple):
    """How a part computes its output rows from its own rows first: the operation runs on own rows
    ``[start, stop)`` with `padding` zero rows at both ends of the split dimension, which gives every
    output row the part holds, those of the `boundaries` with their halo read as zeros; once the halo
    arrives, each boundary's rows are computed again from the rows they read."""

    start: int
    stop: int
    padding: int
    boundaries: tuple[Boundary, ...]


def own_rows(window: Window, size: int, parts: int, index: int) -> OwnRows | None:
    """`OwnRows` for part `index`, or None where padding both ends alike cannot align the windows
    with the part's output rows, or where every output row reads a halo (the part then assembles its
    slab)."""
    out_start, out_stop = part_rows(window.output_size(size), parts, index)
    start, stop = part_rows(size, parts, index)
    first, end = window.reads(out_start, out_stop)
    lo, hi = max(first, start), min(end, stop)
    if out_stop == out_start or hi <= lo or window.ceil_mode:
        return None
    padding, after = lo - first, end - hi
    # Both ends get `padding` rows: the last window must fit in them, and no window beyond it.
    if not 0 <= padding - after < window.stride:
        return None
    spans = []  # output rows whose windows read halo rows, above the own rows and below them
    if first < start and start > 0:
        spans.append([out_start, min(out_stop, -(-(start + window.padding) // window.stride))])
    if end > stop and stop < size:
        below = (stop + window.padding - window.extent) // window.stride + 1
        spans.append([max(out_start, below), out_stop])
    if len(spans) == 2 and spans[0][1] > spans[1][0]:  # rows that read both halos
        spans = [[spans[0][0], spans[1][1]]]
    if sum(b - a for a, b in spans) >= out_stop - out_start:
        return None  # every output row reads a halo: running on the own rows first gains nothing
    boundaries = tuple(Boundary(a - out_start, b - out_start, *window.reads(a, b)) for a, b in spans if b > a)
    return OwnRows(lo, hi, padding, boundaries)
