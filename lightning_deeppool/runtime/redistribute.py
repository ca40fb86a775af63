"""Move a batch tensor's samples (and, under spatial splits, rows) from one layout to another with
point-to-point messages (at most one between two ranks: their blocks overlap in one block)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from lightning_deeppool.comm.messages import WORLD, Messages
from lightning_deeppool.ir.placement import Block, Layout, pieces
from lightning_deeppool.ir.rows import SPLIT_DIM


def redistribute(
    tensor: torch.Tensor | None,
    src: Layout,
    dst: Layout,
    *,
    rank: int,
    sample_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    waiting: Callable[[], AbstractContextManager[None]] = nullcontext,
    messages: Messages = WORLD,
) -> torch.Tensor | None:
    """Return this rank's part of the batch under layout `dst`, given its part under `src`.

    Every rank whose samples move must call it with the same layouts; the others may skip it.
    `tensor` is None on ranks that hold nothing under `src`; ranks that hold nothing under `dst`
    get None back. When either layout splits rows, they are dimension `SPLIT_DIM` of the tensor and
    ``sample_shape[SPLIT_DIM - 1]`` of the whole sample. The pieces travel by `messages` (peers are
    global ranks); the wait for them runs inside `waiting()` (an idle window).
    """
    split = src.spatial > 1 or dst.spatial > 1
    size = sample_shape[SPLIT_DIM - 1] if split else 1
    mine, wanted = src.block(rank, size), dst.block(rank, size)
    out = None
    if wanted.samples:
        shape = (wanted.samples, *sample_shape)
        if split:
            shape = (*shape[:SPLIT_DIM], wanted.rows, *shape[SPLIT_DIM + 1 :])
        out = torch.empty(shape, dtype=dtype, device=device)
    if tensor is not None and out is not None:
        kept = mine.overlap(wanted)
        if kept is not None:
            _region(out, wanted, kept, split).copy_(_region(tensor, mine, kept, split))
    outgoing, incoming, landed = {}, {}, []
    for piece in pieces(src, dst, size):
        if piece.src == rank and tensor is not None:
            # In the value's declared dtype (one device's), whatever precision the sender computed in.
            outgoing[piece.dst] = _region(tensor, mine, piece.block, split).to(dtype).contiguous()
        elif piece.dst == rank and out is not None:
            view = _region(out, wanted, piece.block, split)
            incoming[piece.src] = view if view.is_contiguous() else torch.empty_like(view)
            landed.append((view, incoming[piece.src]))
    if outgoing or incoming:
        posted = messages.post(outgoing, incoming)
        with waiting():
            posted.wait()
    for view, buffer in landed:
        if buffer is not view:
            view.copy_(buffer)
    return out


def block_of_whole(
    whole: torch.Tensor, dst: Layout, rank: int, sample_shape: tuple[int, ...]
) -> torch.Tensor | None:
    """This rank's part under layout `dst` of a batch every rank holds whole (a shared batch), as a
    copy: no messages. None when it holds nothing there."""
    split = dst.spatial > 1
    size = sample_shape[SPLIT_DIM - 1] if split else 1
    wanted = dst.block(rank, size)
    if not wanted.samples:
        return None
    held = Block(0, whole.shape[0], 0, size)
    return _region(whole, held, wanted, split).clone(memory_format=torch.contiguous_format)


def _region(tensor: torch.Tensor, held: Block, part: Block, split: bool) -> torch.Tensor:
    """The view of `part` in `tensor`, which holds `held`."""
    view = tensor.narrow(0, part.start - held.start, part.samples)
    return view.narrow(SPLIT_DIM, part.row_start - held.row_start, part.rows) if split else view
