"""Halo exchange: a part of a spatially split sample gathers the input slab its output rows need
(`planner.spatial.slab`) from its own rows and its neighbours', with point-to-point messages. The
backward sends each halo row's gradient back to the part that holds the row, which adds it. (A
`Transfer` here moves `samples` rows of one sample, not samples.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_deeppool.planner.spatial import Window, halo_moves, part_rows, slab
from lightning_deeppool.strategy.redistribute import post_and_wait


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
        moves = halo_moves(window, size, len(ranks))
        start, stop = part_rows(size, len(ranks), index)
        need = slab(window, size, len(ranks), index)
        ctx.geometry = (dim, moves, start, stop, need, ranks, index, group)
        incoming = sorted((m for m in moves if m.dst == index), key=lambda m: m.start)
        outgoing = {m.dst: local.narrow(dim, m.start - start, m.samples) for m in moves if m.src == index}
        received = _exchange(outgoing, {m.src: m.samples for m in incoming}, local, dim, ranks, group)
        own_lo, own_hi = max(need.start, start), min(need.stop, stop)
        own = [local.narrow(dim, own_lo - start, own_hi - own_lo)] if own_hi > own_lo else []
        return torch.cat(
            [
                _rows(local, dim, need.before, fill),
                *(received[m.src] for m in incoming if m.start < start),
                *own,
                *(received[m.src] for m in incoming if m.start > start),
                _rows(local, dim, need.after, fill),
            ],
            dim,
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        dim, moves, start, stop, need, ranks, index, group = ctx.geometry
        grad_local = grad.new_zeros(_shape(grad, dim, stop - start))
        # The slab's rows, by sample row: each received row's gradient goes back to its sender.
        grad_rows = grad.narrow(dim, need.before, need.stop - need.start) if need.rows else grad
        returned = {
            m.src: grad_rows.narrow(dim, m.start - need.start, m.samples) for m in moves if m.dst == index
        }
        own_lo, own_hi = max(need.start, start), min(need.stop, stop)
        if own_hi > own_lo:
            grad_local.narrow(dim, own_lo - start, own_hi - own_lo).add_(
                grad_rows.narrow(dim, own_lo - need.start, own_hi - own_lo)
            )
        sent = [m for m in moves if m.src == index]
        received = _exchange(returned, {m.dst: m.samples for m in sent}, grad_local, dim, ranks, group)
        for move in sent:
            grad_local.narrow(dim, move.start - start, move.samples).add_(received[move.dst])
        return grad_local, None, None, None, None, None, None, None


def _exchange(
    outgoing: dict[int, torch.Tensor],
    incoming: dict[int, int],
    like: torch.Tensor,
    dim: int,
    ranks: tuple[int, ...],
    group: dist.ProcessGroup | None,
) -> dict[int, torch.Tensor]:
    """Send each `outgoing` tensor to its part and receive `incoming[part]` rows (shaped like `like`
    elsewhere) from each part, all posted at once in part order; the received tensors by part."""
    received = {part: like.new_empty(_shape(like, dim, rows)) for part, rows in incoming.items()}
    ops = sorted(
        [
            *(
                (part, dist.P2POp(dist.isend, t.contiguous(), ranks[part], group))
                for part, t in outgoing.items()
            ),
            *((part, dist.P2POp(dist.irecv, t, ranks[part], group)) for part, t in received.items()),
        ],
        key=lambda pair: pair[0],
    )
    post_and_wait([op for _, op in ops])
    return received


def _rows(like: torch.Tensor, dim: int, rows: int, fill: float) -> torch.Tensor:
    return like.new_full(_shape(like, dim, rows), fill)


def _shape(like: torch.Tensor, dim: int, rows: int) -> tuple[int, ...]:
    """`like`'s shape with `rows` along `dim`."""
    return (*like.shape[:dim], rows, *like.shape[dim + 1 :])
