"""Sample layouts: which rank holds which samples of the global batch, and what moves between two.

A layout is a list of per-rank sample counts over the whole world; rank r holds the contiguous
global samples starting at the sum of the counts before it. A layer of width w holds the global
batch split as evenly as possible over ranks 0..w-1 (earlier ranks take the remainder).

With spatial splits and first ranks (`Placement`, `Layout`), a layer of width w and spatial s holds the
batch in w / s sample groups, each group's samples split by height over its s ranks, from rank `first`
on (a branch beside another runs on ranks of its own); `pieces` is what moves between two such
layouts, rows included.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple


class Transfer(NamedTuple):
    """`samples` samples starting at global sample `start` move from rank `src` to rank `dst`."""

    src: int
    dst: int
    start: int
    samples: int


def balanced(total: int, width: int, world_size: int) -> tuple[int, ...]:
    """Counts for `total` samples split over ranks 0..width-1 of a `world_size` world."""
    if not 1 <= width <= world_size:
        raise ValueError(f"width must be in 1..{world_size}, got {width}")
    base, extra = divmod(total, width)
    return tuple(base + (1 if r < extra else 0) if r < width else 0 for r in range(world_size))


def per_device_batch(global_batch_size: int, width: int) -> int:
    """Samples on the busiest device of a layer of this width (rank 0 takes the remainder)."""
    return math.ceil(global_batch_size / width)


def equal_width_runs(names: Iterable[str], widths: Mapping[str, object]) -> list[list[str]]:
    """`names` in order, cut into maximal runs of consecutive names with one width (or placement)."""
    runs: list[list[str]] = []
    for name in names:
        if runs and widths[runs[-1][0]] == widths[name]:
            runs[-1].append(name)
        else:
            runs.append([name])
    return runs


def offsets(counts: tuple[int, ...]) -> tuple[int, ...]:
    """Global index of each rank's first sample."""
    starts, running = [], 0
    for count in counts:
        starts.append(running)
        running += count
    return tuple(starts)


def transfers(src: tuple[int, ...], dst: tuple[int, ...]) -> list[Transfer]:
    """Sample ranges that change owner going from layout `src` to `dst`, sorted by (src, dst)."""
    if sum(src) != sum(dst) or len(src) != len(dst):
        raise ValueError(f"layouts {src} and {dst} do not describe the same batch")
    moves = []
    src_starts, dst_starts = offsets(src), offsets(dst)
    for s, (s_start, s_count) in enumerate(zip(src_starts, src)):
        for d, (d_start, d_count) in enumerate(zip(dst_starts, dst)):
            lo, hi = max(s_start, d_start), min(s_start + s_count, d_start + d_count)
            if hi > lo and s != d:
                moves.append(Transfer(s, d, lo, hi - lo))
    return moves


def busiest_rank_samples(src: tuple[int, ...], dst: tuple[int, ...]) -> int:
    """Most samples any one rank sends or receives (links are full duplex) between two layouts."""
    sent = [0] * len(src)
    received = [0] * len(src)
    for move in transfers(src, dst):
        sent[move.src] += move.samples
        received[move.dst] += move.samples
    return max((max(s, r) for s, r in zip(sent, received)), default=0)


class Placement(NamedTuple):
    """Where a layer runs: on ranks first..first+width-1, as ``width // spatial`` sample groups of
    `spatial` consecutive ranks, each group's samples split by height in `spatial` parts (1: not
    split). Layers of independent branches run side by side on disjoint rank sets (`first` > 0)."""

    width: int
    spatial: int = 1
    first: int = 0

    @property
    def groups(self) -> int:
        return self.width // self.spatial

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.width)

    def __str__(self) -> str:
        text = str(self.width) if self.spatial == 1 else f"{self.width}s{self.spatial}"
        return f"{text}@{self.first}" if self.first else text

    @classmethod
    def of(cls, value: int | Placement) -> Placement:
        """`value` as a placement: a bare width splits no sample and starts at rank 0."""
        return value if isinstance(value, Placement) else cls(int(value))

    @classmethod
    def parse(cls, text: str) -> Placement:
        """Inverse of `str`: ``"4"``, ``"4s2"``, ``"2@2"`` (ranks 2 and 3) or ``"4s2@4"``."""
        placed, _, first = text.partition("@")
        width, _, spatial = placed.partition("s")
        return cls(int(width), int(spatial or 1), int(first or 0))


class Block(NamedTuple):
    """The part of a batch value one rank holds: samples ``[start, start + samples)`` and, of each,
    rows ``[row_start, row_start + rows)`` of the split dimension."""

    start: int
    samples: int
    row_start: int
    rows: int

    def overlap(self, other: Block) -> Block | None:
        lo, hi = max(self.start, other.start), min(self.start + self.samples, other.start + other.samples)
        row_lo = max(self.row_start, other.row_start)
        row_hi = min(self.row_start + self.rows, other.row_start + other.rows)
        return Block(lo, hi - lo, row_lo, row_hi - row_lo) if hi > lo and row_hi > row_lo else None


@dataclass(frozen=True)
class Layout:
    """Which samples, and which rows of each, every rank of the world holds: sample group g (ranks
    ``first + g * spatial`` to ``first + g * spatial + spatial - 1``) holds `counts[g]` consecutive
    samples, split by rows in `spatial` parts (`rows.row_parts`). Other ranks hold nothing."""

    counts: tuple[int, ...]
    spatial: int
    world_size: int
    first: int = 0

    @classmethod
    def of(cls, placement: Placement, total: int, world_size: int) -> Layout:
        """The balanced layout of `total` samples under `placement`."""
        if (
            placement.width % placement.spatial
            or placement.width < 1
            or not 0 <= placement.first <= world_size - placement.width
        ):
            raise ValueError(f"placement {placement} does not fit a world of {world_size} ranks")
        counts = balanced(total, placement.groups, placement.groups)
        return cls(counts, placement.spatial, world_size, placement.first)

    def _group(self, rank: int) -> int:
        """The sample group `rank` belongs to (-1: none)."""
        group = (rank - self.first) // self.spatial if rank >= self.first else -1
        return group if group < len(self.counts) else -1

    def samples(self, rank: int) -> int:
        """Samples this rank holds (every part of a group holds all of the group's samples)."""
        group = self._group(rank)
        return self.counts[group] if group >= 0 else 0

    def part(self, rank: int) -> tuple[tuple[int, ...], int]:
        """The ranks of this rank's sample group, in part order, and its index among them."""
        index = (rank - self.first) % self.spatial
        return tuple(range(rank - index, rank - index + self.spatial)), index

    def block(self, rank: int, size: int) -> Block:
        """What `rank` holds of a value whose split dimension has `size` rows."""
        group = self._group(rank)
        if group < 0 or not self.counts[group]:
            return Block(0, 0, 0, 0)
        base, extra = divmod(size, self.spatial)
        index = (rank - self.first) % self.spatial
        row_start = index * base + min(index, extra)
        return Block(sum(self.counts[:group]), self.counts[group], row_start, base + (index < extra))


class Piece(NamedTuple):
    """A `Block` of a value that moves from rank `src` to rank `dst`."""

    src: int
    dst: int
    block: Block


@functools.lru_cache(maxsize=4096)
def pieces(src: Layout, dst: Layout, size: int) -> tuple[Piece, ...]:
    """What moves going from layout `src` to `dst` for a value of `size` rows, sorted by (src, dst);
    a rank keeps what it holds under both. Cached: every step of a plan makes the same moves."""
    if sum(src.counts) != sum(dst.counts) or src.world_size != dst.world_size:
        raise ValueError(f"layouts {src} and {dst} do not describe the same batch")
    moves = []
    for s in range(src.world_size):
        held = src.block(s, size)
        for d in range(dst.world_size):
            common = held.overlap(dst.block(d, size)) if s != d else None
            if common is not None:
                moves.append(Piece(s, d, common))
    return tuple(moves)


def busiest_rank_share(src: Layout, dst: Layout, size: int) -> float:
    """Most samples' worth (rows counted as fractions of a sample) any one rank sends or receives
    between two layouts; links are full duplex."""
    sent = [0.0] * src.world_size
    received = [0.0] * src.world_size
    for piece in pieces(src, dst, size):
        share = piece.block.samples * piece.block.rows / size
        sent[piece.src] += share
        received[piece.dst] += share
    return max((max(s, r) for s, r in zip(sent, received)), default=0.0)
