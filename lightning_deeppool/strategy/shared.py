"""A shared batch (`DeepPoolStrategy(shared_batch=True)`): every rank reads the same global batch,
keeps its balanced share of the samples for the plan, and gets the whole batch's outputs back, so
each rank computes one device's loss. This is how a batch smaller than the device count trains."""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from lightning_deeppool.planner.layout import balanced, offsets
from lightning_deeppool.strategy.messages import LocalLinks


def shares(total: int, world_size: int) -> tuple[int, ...]:
    """Samples each rank keeps of a shared batch of `total`: earlier ranks take the remainder, ranks
    past the batch keep none."""
    return balanced(total, world_size, world_size)


def keep_share(tensor: torch.Tensor, counts: tuple[int, ...], rank: int) -> torch.Tensor:
    """This rank's samples (dimension 0) of the shared batch."""
    return tensor.narrow(0, offsets(counts)[rank], counts[rank])


def checksum(tensors: list[torch.Tensor]) -> int:
    """A 63-bit summary of a batch's values, equal on ranks that read the same batch."""
    total = sum(float(t.detach().double().sum()) for t in tensors)
    return struct.unpack("<q", struct.pack("<d", total))[0] >> 1


def gather_batch(
    local: torch.Tensor,
    rows: tuple[int, ...],
    rank: int,
    group: dist.ProcessGroup | None = None,
    links: LocalLinks | None = None,
) -> torch.Tensor:
    """Every rank's `rows[r]` rows of dimension 0, concatenated in rank order, on every rank, by
    collectives over `group` or point-to-point over `links`. Differentiable: each rank's gradient is
    the sum of every rank's gradient for its rows (every rank computed its loss from the whole
    batch)."""
    shares = _Shares(rows, rank, group, links)
    if local.is_floating_point() and local.requires_grad:
        return _Gather.apply(local, shares)
    return _gather(local, shares)


class _Shares(NamedTuple):
    """Who holds which rows of a shared batch, and how the ranks reach each other."""

    rows: tuple[int, ...]
    rank: int
    group: dist.ProcessGroup | None
    links: LocalLinks | None


def _gather(local: torch.Tensor, shares: _Shares) -> torch.Tensor:
    rows, rank = shares.rows, shares.rank
    if shares.links is not None:
        others = {r: local.new_empty((n, *local.shape[1:])) for r, n in enumerate(rows) if r != rank}
        shares.links.post(dict.fromkeys(others, local), others).wait()
        return torch.cat([others.get(r, local) for r in range(len(rows))])
    padded = local.new_zeros((max(rows), *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in rows]
    dist.all_gather(parts, padded, group=shares.group)
    return torch.cat([part[:n] for part, n in zip(parts, rows)])


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, shares: _Shares) -> torch.Tensor:  # type: ignore[override]
        ctx.shares = shares
        return _gather(local.detach(), shares)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        shares: _Shares = ctx.shares
        rows, rank, starts = shares.rows, shares.rank, offsets(shares.rows)
        if shares.links is None:
            total = grad.contiguous().clone()
            dist.all_reduce(total, group=shares.group)
            return total.narrow(0, starts[rank], rows[rank]), None
        mine = grad.narrow(0, starts[rank], rows[rank])
        theirs = {r: mine.new_empty(mine.shape) for r in range(len(rows)) if r != rank}
        shares.links.post({r: grad.narrow(0, starts[r], rows[r]) for r in theirs}, theirs).wait()
        return mine + sum(theirs.values()), None
