"""Halo exchange: a spatially local operation (a convolution, a pooling) on one part of a sample split
by rows. The part posts the rows its neighbours need and receives theirs (`planner.spatial.halo_moves`),
copies its own rows into the slab its output rows read while the messages are in flight, then runs the
operation once on the whole slab. The slab is not kept for backward: it is rebuilt from the part's
rows and the small halo, so a part stores no more than one device would for its rows. The backward
sends each halo row's gradient back to the part that holds the row, which adds it. (A `Transfer` here
moves `samples` rows of one sample, not samples.)"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from lightning_deeppool.planner.layout import Transfer
from lightning_deeppool.planner.spatial import Slab, Window, halo_moves, part_rows, slab

Params = tuple[torch.Tensor | None, ...]


class Kernel(Protocol):
    """An operation with `window` along the split dimension, run on slabs (unpadded along it;
    padding rows hold `fill`), with its own backward."""

    @property
    def window(self) -> Window: ...

    @property
    def fill(self) -> float: ...

    def forward(self, slab: torch.Tensor, params: Params) -> tuple[torch.Tensor, Any]:
        """The output and what `backward` needs besides the slab."""

    def input_grad(self, grad: torch.Tensor, shape: torch.Size, params: Params, saved: Any) -> torch.Tensor:
        """The gradient of a slab of `shape` (its values are not needed)."""

    def param_grads(
        self,
        grad: torch.Tensor,
        slab: Callable[[], torch.Tensor],
        params: Params,
        saved: Any,
        wanted: Sequence[bool],
    ) -> Params:
        """The gradients of the parameters (`wanted` of them; `slab()` rebuilds the slab)."""


class _Geometry(NamedTuple):
    dim: int
    start: int  # this part's rows [start, stop)
    stop: int
    need: Slab  # the rows its output rows read
    moves: list[Transfer]
    ranks: tuple[int, ...]
    part: int  # this part's index
    group: dist.ProcessGroup | None

    @property
    def incoming(self) -> list[Transfer]:
        return sorted((m for m in self.moves if m.dst == self.part), key=lambda m: m.start)

    @property
    def outgoing(self) -> list[Transfer]:
        return [m for m in self.moves if m.src == self.part]

    def own(self) -> tuple[int, int]:
        """The rows of its own the part's slab holds."""
        return max(self.need.start, self.start), min(self.need.stop, self.stop)


def windowed(
    local: torch.Tensor,
    kernel: Kernel,
    params: Params,
    *,
    dim: int,
    size: int,
    ranks: Sequence[int],
    index: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """`kernel` over the whole sample, for the output rows part `index` holds along `dim`. `local`
    holds this part's rows of a dimension of `size` rows split over the global `ranks`. Every part of
    `ranks` must call it with the same arguments but `local` and `index`. Differentiable in `local`
    and `params`."""
    parts = len(ranks)
    start, stop = part_rows(size, parts, index)
    need = slab(kernel.window, size, parts, index)
    moves = halo_moves(kernel.window, size, parts)
    geometry = _Geometry(dim, start, stop, need, moves, tuple(ranks), index, group)
    return _Windowed.apply(local, kernel, geometry, *params)


class _Windowed(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, local: torch.Tensor, kernel: Kernel, geometry: _Geometry, *params: torch.Tensor | None
    ) -> torch.Tensor:
        dim = geometry.dim
        received = [local.new_empty(_shape(local, dim, m.samples)) for m in geometry.incoming]
        outgoing = {m.dst: local.narrow(dim, m.start - geometry.start, m.samples) for m in geometry.outgoing}
        incoming = {m.src: t for m, t in zip(geometry.incoming, received)}
        pending = _post(outgoing, incoming, geometry.ranks, geometry.group)
        # Copying the own rows overlaps the messages.
        assembled = _assemble(local, received, geometry, kernel.fill, pending)
        out, saved = kernel.forward(assembled, params)
        ctx.kernel, ctx.geometry, ctx.saved, ctx.dtype = kernel, geometry, saved, out.dtype
        ctx.save_for_backward(local, *received, *(p for p in params if p is not None))
        ctx.present = [p is not None for p in params]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        geometry: _Geometry = ctx.geometry
        kernel: Kernel = ctx.kernel
        local, *rest = ctx.saved_tensors
        received, given = rest[: len(geometry.incoming)], iter(rest[len(geometry.incoming) :])
        params = tuple(next(given) if present else None for present in ctx.present)
        dim, need = geometry.dim, geometry.need
        shape = torch.Size(_shape(local, dim, need.rows))
        grad_slab = kernel.input_grad(grad, shape, params, ctx.saved).to(local.dtype)
        returned = {
            m.src: grad_slab.narrow(dim, need.before + m.start - need.start, m.samples)
            for m in geometry.incoming
        }
        arriving = {m.dst: local.new_empty(_shape(local, dim, m.samples)) for m in geometry.outgoing}
        pending = _post(returned, arriving, geometry.ranks, geometry.group)
        # The parameters' gradients (and the slab they need, rebuilt) overlap the messages.
        grad_params = kernel.param_grads(
            grad,
            lambda: _assemble(local, received, geometry, kernel.fill).to(ctx.dtype),
            params,
            ctx.saved,
            ctx.needs_input_grad[3:],
        )
        own_lo, own_hi = geometry.own()
        if own_lo == geometry.start and own_hi == geometry.stop:
            grad_local = grad_slab.narrow(dim, need.before + own_lo - need.start, own_hi - own_lo)
        else:  # the slab reads only some of the part's rows: the others get no gradient from it
            grad_local = torch.zeros_like(local)
            if own_hi > own_lo:
                grad_local.narrow(dim, own_lo - geometry.start, own_hi - own_lo).copy_(
                    grad_slab.narrow(dim, need.before + own_lo - need.start, own_hi - own_lo)
                )
        pending.wait()
        for move in geometry.outgoing:
            grad_local.narrow(dim, move.start - geometry.start, move.samples).add_(arriving[move.dst])
        return (grad_local, None, None, *grad_params)


def _assemble(
    local: torch.Tensor,
    received: Sequence[torch.Tensor],
    geometry: _Geometry,
    fill: float,
    pending: _Pending | None = None,
) -> torch.Tensor:
    """The slab: padding rows, the halo rows before the own rows, the own rows, the halo rows after,
    padding rows. With `pending` messages, waits for them after copying the own rows."""
    dim, need = geometry.dim, geometry.need
    out = local.new_empty(_shape(local, dim, need.rows))
    own_lo, own_hi = geometry.own()
    if own_hi > own_lo:
        out.narrow(dim, need.before + own_lo - need.start, own_hi - own_lo).copy_(
            local.narrow(dim, own_lo - geometry.start, own_hi - own_lo)
        )
    out.narrow(dim, 0, need.before).fill_(fill)
    out.narrow(dim, need.rows - need.after, need.after).fill_(fill)
    if pending is not None:
        pending.wait()
    for move, rows in zip(geometry.incoming, received):
        out.narrow(dim, need.before + move.start - need.start, move.samples).copy_(rows)
    return out


def gather_parts(
    mine: torch.Tensor, ranks: Sequence[int], index: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Every part's `mine` (same shape everywhere), stacked in part order, by point-to-point messages:
    for the few small tensors of a spatial group, cheaper than a collective on gloo."""
    others = {part: torch.empty_like(mine) for part in range(len(ranks)) if part != index}
    _post(dict.fromkeys(others, mine), others, tuple(ranks), group).wait()
    return torch.stack([others.get(part, mine) for part in range(len(ranks))])


class _Pending(NamedTuple):
    """Posted messages, and the tensors they read or write (kept alive until they complete)."""

    works: list[dist.Work]
    ops: list[dist.P2POp]

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _post(
    outgoing: dict[int, torch.Tensor],
    incoming: dict[int, torch.Tensor],
    ranks: tuple[int, ...],
    group: dist.ProcessGroup | None,
) -> _Pending:
    """Send each `outgoing` tensor to its part and receive each `incoming` buffer from its part, all
    posted at once in part order."""
    ops = [
        op
        for _, op in sorted(
            [
                *(
                    (part, dist.P2POp(dist.isend, t.detach().contiguous(), ranks[part], group))
                    for part, t in outgoing.items()
                ),
                *((part, dist.P2POp(dist.irecv, t, ranks[part], group)) for part, t in incoming.items()),
            ],
            key=lambda pair: pair[0],
        )
    ]
    return _Pending(list(dist.batch_isend_irecv(ops)) if ops else [], ops)


def _shape(like: torch.Tensor, dim: int, rows: int) -> tuple[int, ...]:
    """`like`'s shape with `rows` along `dim`."""
    return (*like.shape[:dim], rows, *like.shape[dim + 1 :])
