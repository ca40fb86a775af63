"""A shared batch (`DeepPoolStrategy(shared_batch=True)`): every rank reads the same global batch,
keeps its balanced share of the samples for the plan, and gets the whole batch's outputs back, so
each rank computes one device's loss. This is how a batch smaller than the device count trains."""

from __future__ import annotations

from typing import Any

import torch

from lightning_deeppool.comm.messages import Messages
from lightning_deeppool.ir.placement import balanced, offsets


def shares(total: int, world_size: int) -> tuple[int, ...]:
    """Samples each rank keeps of a shared batch of `total`: earlier ranks take the remainder, ranks
    past the batch keep none."""
    return balanced(total, world_size, world_size)


def keep_share(tensor: torch.Tensor, counts: tuple[int, ...], rank: int) -> torch.Tensor:
    """This rank's samples (dimension 0) of the shared batch."""
    return tensor.narrow(0, offsets(counts)[rank], counts[rank])


_CHUNK = 97  # words: a prime, so that no image row or channel aligns with chunks


def checksum(tensors: list[torch.Tensor]) -> int:
    """A 62-bit summary of a batch's bytes that changes when any value or its place changes (a rank's
    flipped or reordered copy of the batch too), equal on ranks that read the same batch."""
    total = 0
    for t in tensors:
        total = total * 1_000_003 + _bytes_summary(t.detach().contiguous().view(-1).view(torch.uint8))
    return total % (1 << 62)


def _bytes_summary(raw: torch.Tensor) -> int:
    """The bytes' 64-bit words summed in chunks of `_CHUNK`, each chunk's sum times its position:
    exact in any order, on any device, and moving values between chunks changes it (a CRC of the
    bytes took 5x as long on a CPU)."""
    if raw.numel() % 8 or raw.storage_offset() % 8:
        raw = torch.cat([raw, raw.new_zeros(-raw.numel() % 8)])
    words = raw.view(torch.int64)
    whole = words.numel() - words.numel() % _CHUNK
    sums = torch.cat([words[:whole].view(-1, _CHUNK).sum(1), words[whole:].sum().view(1)])
    positions = torch.arange(1, sums.numel() + 1, dtype=torch.int64, device=sums.device)
    return int(sums.mul(positions).sum())


def gather_batch(mine: torch.Tensor, rows: tuple[int, ...], messages: Messages) -> torch.Tensor:
    """Every rank's `rows[r]` rows of dimension 0, concatenated in rank order, on every rank, by
    `messages`. Differentiable: each rank's gradient is the sum of every rank's gradient for its rows
    (every rank computed its loss from the whole batch)."""
    if mine.is_floating_point() and mine.requires_grad:
        return _Gather.apply(mine, rows, messages)
    return messages.all_gather(mine, rows)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, mine: torch.Tensor, rows: tuple[int, ...], messages: Messages) -> torch.Tensor:  # type: ignore[override]
        ctx.rows, ctx.messages = rows, messages
        return messages.all_gather(mine.detach(), rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return ctx.messages.reduce_scatter(grad, ctx.rows), None, None
