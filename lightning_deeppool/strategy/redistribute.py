"""Move a batch tensor's samples from one layout to another with point-to-point messages."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist

from lightning_deeppool.planner.layout import offsets, transfers


def redistribute(
    local: torch.Tensor | None,
    src: tuple[int, ...],
    dst: tuple[int, ...],
    *,
    rank: int,
    sample_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    waiting: Callable[[], AbstractContextManager[None]] = nullcontext,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor | None:
    """Return this rank's part of the batch under layout `dst`, given its part under `src`.

    Every rank whose samples move must call it with the same layouts; the others may skip it.
    `local` is None on ranks that hold nothing under `src`; ranks that hold nothing under `dst`
    get None back. Messages are posted sorted by peer so every pair of ranks agrees on order.
    The wait for them runs inside `waiting()` (an idle window); `group` (default: the world) must
    contain every rank, peers being global ranks.
    """
    src_start, dst_start = offsets(src)[rank], offsets(dst)[rank]
    out = torch.empty((dst[rank], *sample_shape), dtype=dtype, device=device) if dst[rank] else None
    if local is not None and out is not None:
        lo, hi = max(src_start, dst_start), min(src_start + src[rank], dst_start + dst[rank])
        if hi > lo:
            out[lo - dst_start : hi - dst_start].copy_(local[lo - src_start : hi - src_start])
    ops = []
    for move in transfers(src, dst):
        if move.src == rank and local is not None:
            piece = local[move.start - src_start : move.start - src_start + move.samples].contiguous()
            ops.append(dist.P2POp(dist.isend, piece, move.dst, group))
        elif move.dst == rank and out is not None:
            view = out[move.start - dst_start : move.start - dst_start + move.samples]
            ops.append(dist.P2POp(dist.irecv, view, move.src, group))
    post_and_wait(ops, waiting)
    return out


def post_and_wait(
    ops: list[dist.P2POp], waiting: Callable[[], AbstractContextManager[None]] = nullcontext
) -> None:
    """Post point-to-point messages at once and wait for all of them inside `waiting()`."""
    if ops:
        works = dist.batch_isend_irecv(ops)
        with waiting():
            for work in works:
                work.wait()
