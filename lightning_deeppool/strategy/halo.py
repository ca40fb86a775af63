"""Halo exchange: a part of a spatially split sample gathers the input slab its output rows need
(`planner.spatial.slab`) from its own rows and its neighbours', with point-to-point messages. The
backward sends each halo row's gradient back to the part that holds the row, which adds it. (A
`Transfer` here moves `samples` rows of one sample, not samples.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_deeppool.planner.layout import Transfer, offsets
from lightning_deeppool.planner.spatial import Window, halo_moves, row_parts, slab


def gather_slab(
    local: torch.Tensor,
    *,
    dim: int,
    size: int,
    window: Window,
    ranks: Sequence[int],
    index: int,
    fill: float = 0.0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The input slab for the output rows part `index` holds along `dim`, from `local` (this part's
    rows of a dimension of `size` rows split over the global `ranks`) and the neighbours' rows;
    padding rows hold `fill` (0 for convolutions, ``-inf`` for max pooling). Every part of `ranks`
    must call it with the same arguments but `local` and `index`. Differentiable."""
    return _GatherSlab.apply(local, dim, size, window, tuple(ranks), index, fill, group)


class _GatherSlab(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        local: torch.Tensor,
        dim: int,
        size: int,
        window: Window,
        ranks: tuple[int, ...],
        index: int,
        fill: float,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.geometry = (dim, size, window, ranks, index, group)
        moves = halo_moves(window, size, len(ranks))
        start = offsets(row_parts(size, len(ranks)))[index]
        need = slab(window, size, len(ranks), index)
        received = _exchange(local, moves, index, start, ranks, group, dim, backward=False)
        pieces = [_rows(local, dim, need.before, fill)]
        for move in sorted((m for m in moves if m.dst == index), key=lambda m: m.start):
            if move.start < start:
                pieces.append(received[move.src])
        own_lo, own_hi = max(need.start, start), min(need.stop, start + local.shape[dim])
        if own_hi > own_lo:
            pieces.append(local.narrow(dim, own_lo - start, own_hi - own_lo))
        for move in sorted((m for m in moves if m.dst == index), key=lambda m: m.start):
            if move.start > start:
                pieces.append(received[move.src])
        pieces.append(_rows(local, dim, need.after, fill))
        return torch.cat(pieces, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        dim, size, window, ranks, index, group = ctx.geometry
        moves = halo_moves(window, size, len(ranks))
        counts = row_parts(size, len(ranks))
        start = offsets(counts)[index]
        need = slab(window, size, len(ranks), index)
        grad_local = grad.new_zeros((*grad.shape[:dim], counts[index], *grad.shape[dim + 1 :]))
        # The slab's rows, by sample row: each received row's gradient goes back to its sender.
        grad_rows = grad.narrow(dim, need.before, need.stop - need.start) if need.rows else grad
        returned = {
            move.src: grad_rows.narrow(dim, move.start - need.start, move.samples).contiguous()
            for move in moves
            if move.dst == index
        }
        own_lo, own_hi = max(need.start, start), min(need.stop, start + counts[index])
        if own_hi > own_lo:
            grad_local.narrow(dim, own_lo - start, own_hi - own_lo).add_(
                grad_rows.narrow(dim, own_lo - need.start, own_hi - own_lo)
            )
        received = _exchange(
            grad_local, moves, index, start, ranks, group, dim, backward=True, sending=returned
        )
        for move in moves:
            if move.src == index:
                grad_local.narrow(dim, move.start - start, move.samples).add_(received[move.dst])
        return grad_local, None, None, None, None, None, None, None


def _exchange(
    local: torch.Tensor,
    moves: list[Transfer],
    index: int,
    start: int,
    ranks: tuple[int, ...],
    group: dist.ProcessGroup | None,
    dim: int,
    *,
    backward: bool,
    sending: dict[int, torch.Tensor] | None = None,
) -> dict[int, torch.Tensor]:
    """Post every message of this part at once, sorted by peer, and wait. Forward: send the rows
    peers need, receive the rows this part needs (by sender). Backward: the reverse, the gradients
    of received rows in `sending` (by their sender) going back; returns received ones by receiver."""
    ops, received = [], {}
    for move in moves:
        if index not in (move.src, move.dst):
            continue
        peer = move.dst if move.src == index else move.src
        sends = (move.src == index) != backward
        if sends:
            if backward:
                assert sending is not None
                piece = sending[peer]
            else:
                piece = local.narrow(dim, move.start - start, move.samples).contiguous()
            ops.append((peer, dist.P2POp(dist.isend, piece, ranks[peer], group)))
        else:
            buffer = local.new_empty((*local.shape[:dim], move.samples, *local.shape[dim + 1 :]))
            received[peer] = buffer
            ops.append((peer, dist.P2POp(dist.irecv, buffer, ranks[peer], group)))
    if ops:
        for work in dist.batch_isend_irecv([op for _, op in sorted(ops, key=lambda pair: pair[0])]):
            work.wait()
    return received


def _rows(like: torch.Tensor, dim: int, rows: int, fill: float) -> torch.Tensor:
    return like.new_full((*like.shape[:dim], rows, *like.shape[dim + 1 :]), fill)
