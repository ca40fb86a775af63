"""Sample layouts: which rank holds which samples of the global batch, and what moves between two.

A layout is a list of per-rank sample counts over the whole world; rank r holds the contiguous
global samples starting at the sum of the counts before it. A layer of width w holds the global
batch split as evenly as possible over ranks 0..w-1 (earlier ranks take the remainder).
"""

from __future__ import annotations

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
