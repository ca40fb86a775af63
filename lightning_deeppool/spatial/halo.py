"""Halo exchange: a spatially mine operation (a convolution, a pooling) on one part of a sample split
by rows. The part posts the rows its neighbours need and receives theirs (`ir.rows.halo_moves`).

A convolution (a `PaddedKernel`) runs on the part's own rows while the messages are in flight, padded
with zeros at both ends; once the halo arrives, the few output rows whose windows read it are computed
again from their real inputs and replace those rows (`ir.rows.own_rows`). Its backward
computes the halo rows' gradients first and sends them back to the parts that hold the rows, then,
while they travel, the own rows' gradient (an input's gradient does not depend on its values, so the
padded run gives it whole) and the parameters' (the padded run's, plus what the halo rows add).

Any other operation (or a geometry the padding cannot align) copies its own rows into the slab its
output rows read while the messages fly, and runs once on the whole slab; its backward sends each halo
row's gradient back after computing the slab's. No slab is kept for backward: a part stores no more
than one device would for its rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from lightning_deeppool.comm.messages import Posted
from lightning_deeppool.ir.rows import (
    Boundary,
    OwnRows,
    RowMove,
    Slab,
    Window,
    halo_moves,
    own_rows,
    slab,
)
from lightning_deeppool.spatial.part import SpatialPart

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


@runtime_checkable
class PaddedKernel(Kernel, Protocol):
    """A kernel that can also run padded with zero rows at both ends of the split dimension, so a part
    can run it on its own rows before the halo arrives (see the module docstring)."""

    def padded(self, rows: int) -> PaddedKernel:
        """The same kernel with `rows` zero rows at both ends of the split dimension."""

    def halo_grads(
        self, grad: torch.Tensor, halo: torch.Tensor, params: Params, wanted: Sequence[bool]
    ) -> tuple[torch.Tensor | None, Params]:
        """In one call, for output rows `grad` read from a slab holding only the halo (zeros
        elsewhere): the slab's gradient (its values are not needed) and what the halo adds to the
        parameters' gradients (`wanted`, input first): those must be linear in the input."""

    def grads(
        self, grad: torch.Tensor, x: torch.Tensor, params: Params, wanted: Sequence[bool]
    ) -> tuple[torch.Tensor | None, ...]:
        """The gradients of `x` and of the parameters (`wanted`, input first) in one backward call."""


class _Geometry(NamedTuple):
    dim: int
    start: int  # this part's rows [start, stop)
    stop: int
    need: Slab  # the rows its output rows read
    moves: list[RowMove]
    part: SpatialPart
    own_rows: OwnRows | None  # how a padded kernel runs on the own rows first (None: on the slab)

    @property
    def incoming(self) -> list[RowMove]:
        return sorted((m for m in self.moves if m.dst == self.part.index), key=lambda m: m.start)

    @property
    def outgoing(self) -> list[RowMove]:
        return [m for m in self.moves if m.src == self.part.index]

    def own(self) -> tuple[int, int]:
        """The rows of its own the part's slab holds."""
        return max(self.need.start, self.start), min(self.need.stop, self.stop)

    def whole(self) -> bool:
        """Whether the part's slab is exactly its own rows: nothing to receive, nothing to pad."""
        return (self.need.before, self.need.after) == (0, 0) and self.own() == (self.start, self.stop)


def windowed(
    mine: torch.Tensor, kernel: Kernel, params: Params, *, dim: int, size: int, part: SpatialPart
) -> torch.Tensor:
    """`kernel` over the whole sample, for the output rows `part` holds along `dim`. `mine` holds the
    part's rows of a dimension of `size` rows. Every part of the group must call it with the same
    arguments but `mine` and `part.index`. Differentiable in `mine` and `params`."""
    parts, index = part.parts, part.index
    start, stop = part.rows(size)
    need = slab(kernel.window, size, parts, index)
    moves = halo_moves(kernel.window, size, parts)
    first = own_rows(kernel.window, size, parts, index) if isinstance(kernel, PaddedKernel) else None
    geometry = _Geometry(dim, start, stop, need, moves, part, first)
    function = _Windowed if first is None else _OwnRowsFirst
    return function.apply(mine, kernel, geometry, *params)


class _Windowed(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, mine: torch.Tensor, kernel: Kernel, geometry: _Geometry, *params: torch.Tensor | None
    ) -> torch.Tensor:
        received, pending = _exchange_halo(mine, geometry)
        # Copying the own rows overlaps the messages.
        assembled = _assemble(mine, received, geometry, kernel.fill, pending)
        out, saved = kernel.forward(assembled, params)
        _save(ctx, kernel, geometry, out, mine, received, params)
        ctx.saved = saved
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        geometry: _Geometry = ctx.geometry
        kernel: Kernel = ctx.kernel
        mine, received, params = _saved(ctx)
        dim, need = geometry.dim, geometry.need
        exchange = None
        if ctx.needs_input_grad[0]:  # the same on every part, as in `_OwnRowsFirst`
            shape = torch.Size(_shape(mine, dim, need.rows))
            grad_slab = kernel.input_grad(grad, shape, params, ctx.saved).to(mine.dtype)
            returned = {
                m.src: grad_slab.narrow(dim, need.before + m.start - need.start, m.rows)
                for m in geometry.incoming
            }
            exchange = _return_halo_grads(returned, mine, geometry)
        # The parameters' gradients (and the slab they need, rebuilt) overlap the messages.
        grad_params = kernel.param_grads(
            grad,
            lambda: _assemble(mine, received, geometry, kernel.fill).to(ctx.dtype),
            params,
            ctx.saved,
            ctx.needs_input_grad[3:],
        )
        if exchange is None:
            return (None, None, None, *grad_params)
        own_lo, own_hi = geometry.own()
        if own_hi <= own_lo:  # the slab reads none of the part's rows
            own_lo, own_hi = geometry.start, geometry.start
        grad_own = grad_slab.narrow(dim, max(0, need.before + own_lo - need.start), own_hi - own_lo)
        return (_grad_local(mine, geometry, own_lo, grad_own, *exchange), None, None, *grad_params)


class _OwnRowsFirst(torch.autograd.Function):
    """A padded kernel's rows: computed from the own rows while the halo travels, then the rows that
    read the halo computed again from their real inputs (see the module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, mine: torch.Tensor, kernel: PaddedKernel, geometry: _Geometry, *params: torch.Tensor | None
    ) -> torch.Tensor:
        dim, own = geometry.dim, geometry.own_rows
        assert own is not None
        received, pending = _exchange_halo(mine, geometry)
        out, _ = kernel.padded(own.padding).forward(_own_input(mine, geometry), params)
        pending.wait()
        for boundary in own.boundaries:
            rows, _ = kernel.forward(_boundary_slab(mine, received, geometry, boundary), params)
            _rows(out, dim, boundary).copy_(rows)
        _save(ctx, kernel, geometry, out, mine, received, params)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        geometry: _Geometry = ctx.geometry
        kernel: PaddedKernel = ctx.kernel
        own = geometry.own_rows
        assert own is not None
        mine, received, params = _saved(ctx)
        dim, wants_input = geometry.dim, ctx.needs_input_grad[0]
        wanted = (wants_input, *ctx.needs_input_grad[3:])
        # First, per boundary, the halo rows' gradients (sent at once, to travel while the rest is
        # computed) and what the halo adds to the weights' gradients.
        halo_grads = [
            kernel.halo_grads(
                _rows(grad, dim, b),
                _boundary_slab(mine, received, geometry, b, ctx.dtype, own=False),
                params,
                wanted,
            )
            for b in own.boundaries
        ]
        exchange = None
        if wants_input:  # the same on every part: each runs this layer on its rows of the same value
            slab_grads = [slab_grad for slab_grad, _ in halo_grads if slab_grad is not None]
            returned = {
                m.src: _halo_grad(slab_grads, own.boundaries, m, dim).to(mine.dtype)
                for m in geometry.incoming
            }
            exchange = _return_halo_grads(returned, mine, geometry)
        # An input's gradient does not depend on its values: the own rows' run gives the own rows'
        # whole gradient. The weights' does: the halo rows add theirs to the own rows' run's.
        grad_x, *grad_params = kernel.padded(own.padding).grads(
            grad, _own_input(mine, geometry), params, wanted
        )
        for _, extra in halo_grads:
            grad_params = [g if e is None else e if g is None else g + e for g, e in zip(grad_params, extra)]
        if exchange is None:
            return (None, None, None, *grad_params)
        assert grad_x is not None
        return (_grad_local(mine, geometry, own.start, grad_x, *exchange), None, None, *grad_params)


def _exchange_halo(mine: torch.Tensor, geometry: _Geometry) -> tuple[list[torch.Tensor], Posted]:
    """Post the rows the neighbours need and the buffers for the halo rows they send."""
    dim = geometry.dim
    received = [mine.new_empty(_shape(mine, dim, m.rows)) for m in geometry.incoming]
    outgoing = {m.dst: mine.narrow(dim, m.start - geometry.start, m.rows) for m in geometry.outgoing}
    incoming = {m.src: t for m, t in zip(geometry.incoming, received)}
    return received, geometry.part.post(outgoing, incoming)


def _return_halo_grads(
    returned: dict[int, torch.Tensor], mine: torch.Tensor, geometry: _Geometry
) -> tuple[dict[int, torch.Tensor], Posted]:
    """Post the halo rows' gradients to the parts that hold those rows, and the buffers for the
    gradients of the own rows the neighbours read."""
    arriving = {m.dst: mine.new_empty(_shape(mine, geometry.dim, m.rows)) for m in geometry.outgoing}
    return arriving, geometry.part.post(returned, arriving)


def _grad_local(
    mine: torch.Tensor,
    geometry: _Geometry,
    start: int,
    grad_own: torch.Tensor,
    arriving: dict[int, torch.Tensor],
    pending: Posted,
) -> torch.Tensor:
    """The part's gradient: `grad_own` for its rows from `start` on (the others get none from this
    layer), plus what the neighbours' halos sent back."""
    dim = geometry.dim
    if (start, start + grad_own.shape[dim]) == (geometry.start, geometry.stop):
        grad_local = grad_own
    else:  # the outputs read only some of the part's rows
        grad_local = torch.zeros_like(mine)
        grad_local.narrow(dim, start - geometry.start, grad_own.shape[dim]).copy_(grad_own)
    pending.wait()
    for move in geometry.outgoing:
        grad_local.narrow(dim, move.start - geometry.start, move.rows).add_(arriving[move.dst])
    return grad_local


def _save(
    ctx: Any,
    kernel: Kernel,
    geometry: _Geometry,
    out: torch.Tensor,
    mine: torch.Tensor,
    received: Sequence[torch.Tensor],
    params: Params,
) -> None:
    ctx.kernel, ctx.geometry, ctx.dtype = kernel, geometry, out.dtype
    ctx.save_for_backward(mine, *received, *(p for p in params if p is not None))
    ctx.present = [p is not None for p in params]


def _saved(ctx: Any) -> tuple[torch.Tensor, list[torch.Tensor], Params]:
    """What `_save` kept: the part's rows, the halo it received, the parameters."""
    mine, *rest = ctx.saved_tensors
    count = len(ctx.geometry.incoming)
    given = iter(rest[count:])
    return mine, list(rest[:count]), tuple(next(given) if present else None for present in ctx.present)


def _own_input(mine: torch.Tensor, geometry: _Geometry) -> torch.Tensor:
    """The own rows a padded kernel's output rows read (all of them but at odd strides)."""
    own = geometry.own_rows
    assert own is not None
    if (own.start, own.stop) == (geometry.start, geometry.stop):
        return mine
    return mine.narrow(geometry.dim, own.start - geometry.start, own.stop - own.start)


def _rows(values: torch.Tensor, dim: int, boundary: Boundary) -> torch.Tensor:
    """A boundary's output rows of `values` (the part's output, or its gradient)."""
    return values.narrow(dim, boundary.out_start, boundary.out_stop - boundary.out_start)


def _boundary_slab(
    mine: torch.Tensor,
    received: Sequence[torch.Tensor],
    geometry: _Geometry,
    boundary: Boundary,
    dtype: torch.dtype | None = None,
    own: bool = True,
) -> torch.Tensor:
    """The rows a boundary's outputs read: halo rows, own rows (zeros without `own`), zeros for
    padding; in `dtype` (default: the part's)."""
    dim = geometry.dim
    out = mine.new_zeros(_shape(mine, dim, boundary.stop - boundary.start), dtype=dtype)
    pieces = [(m.start, rows) for m, rows in zip(geometry.incoming, received)]
    if own:
        pieces.append((geometry.start, mine))
    for start, rows in pieces:
        lo, hi = max(start, boundary.start), min(start + rows.shape[dim], boundary.stop)
        if hi > lo:
            out.narrow(dim, lo - boundary.start, hi - lo).copy_(rows.narrow(dim, lo - start, hi - lo))
    return out


def _halo_grad(
    slab_grads: Sequence[torch.Tensor], boundaries: Sequence[Boundary], move: RowMove, dim: int
) -> torch.Tensor:
    """The gradient of a halo move's rows: the sum of every boundary slab's gradient for them (rows
    between a strided kernel's windows get none)."""
    total = slab_grads[0].new_zeros(_shape(slab_grads[0], dim, move.rows))
    for boundary, slab_grad in zip(boundaries, slab_grads):
        lo, hi = max(move.start, boundary.start), min(move.start + move.rows, boundary.stop)
        if hi > lo:
            total.narrow(dim, lo - move.start, hi - lo).add_(
                slab_grad.narrow(dim, lo - boundary.start, hi - lo)
            )
    return total


def _assemble(
    mine: torch.Tensor,
    received: Sequence[torch.Tensor],
    geometry: _Geometry,
    fill: float,
    pending: Posted | None = None,
) -> torch.Tensor:
    """The slab: padding rows, the halo rows before the own rows, the own rows, the halo rows after,
    padding rows. With `pending` messages, waits for them after copying the own rows. A slab of
    exactly the own rows is `mine` itself, not a copy."""
    dim, need = geometry.dim, geometry.need
    if geometry.whole() and not received:
        if pending is not None:
            pending.wait()  # the rows it sends must outlive the messages
        return mine
    out = mine.new_empty(_shape(mine, dim, need.rows))
    own_lo, own_hi = geometry.own()
    if own_hi > own_lo:
        out.narrow(dim, need.before + own_lo - need.start, own_hi - own_lo).copy_(
            mine.narrow(dim, own_lo - geometry.start, own_hi - own_lo)
        )
    out.narrow(dim, 0, need.before).fill_(fill)
    out.narrow(dim, need.rows - need.after, need.after).fill_(fill)
    if pending is not None:
        pending.wait()
    for move, rows in zip(geometry.incoming, received):
        out.narrow(dim, need.before + move.start - need.start, move.rows).copy_(rows)
    return out


def _shape(like: torch.Tensor, dim: int, rows: int) -> tuple[int, ...]:
    """`like`'s shape with `rows` along `dim`."""
    return (*like.shape[:dim], rows, *like.shape[dim + 1 :])
