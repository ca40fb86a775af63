"""BatchNorm on spatially split samples: the statistics are reduced over every part's rows, so a part
normalizes with the statistics one device would compute over the whole samples."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.nn import functional as F

from lightning_deeppool.comm.messages import WORLD, Messages
from lightning_deeppool.spatial.halo import gather_parts


def split_batch_norm(
    local: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    training: bool,
    momentum: float,
    eps: float,
    dim: int,
    size: int,
    ranks: Sequence[int],
    index: int,
    messages: Messages = WORLD,
) -> torch.Tensor:
    """`F.batch_norm` for `local`, this part's rows of samples whose dimension `dim` (of `size` rows
    in all) is split over the parts on global `ranks`, this one part `index` (channels at dimension 1);
    the parts exchange statistics by `messages`. In training, mean and
    variance come from every part (all-reduced) and the running statistics are updated with them as
    one device would; in evaluation the running statistics are used as they are. Saves only its input
    for backward, as the native BatchNorm does."""
    if not training:
        return F.batch_norm(local, running_mean, running_var, weight, bias, False, momentum, eps)
    # Values per channel over every part: known from the shapes, so no collective counts them.
    total = float(size * math.prod(n for i, n in enumerate(local.shape) if i not in (1, dim)))
    out, mean, var = _SplitNorm.apply(local, weight, bias, total, eps, _Parts(tuple(ranks), index, messages))
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            running_mean.lerp_(mean.to(running_mean.dtype), momentum)
            unbiased = var * (total / max(total - 1.0, 1.0))
            running_var.lerp_(unbiased.to(running_var.dtype), momentum)
    return out


class _Parts(NamedTuple):
    """The parts of a spatial group: their global ranks, this one's index, how they exchange."""

    ranks: tuple[int, ...]
    part: int
    messages: Messages

    def gather(self, mine: torch.Tensor) -> torch.Tensor:
        return gather_parts(mine, self.ranks, self.part, self.messages)


def _statistics(x: torch.Tensor, total: float, parts: _Parts) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, the mean and (biased) variance over every part's values: each part's own, combined
    exactly (Chan et al.'s pairwise formula, no cancellation) after one exchange."""
    dims, values = [0, *range(2, x.dim())], x.numel() / x.shape[1]
    # In at least float32 (as the native kernel accumulates), in two passes (torch.var_mean is several
    # times slower here on CPU).
    exact = torch.promote_types(x.dtype, torch.float32)
    mean = x.sum(dims, dtype=exact) / values
    var = torch.sub(x, mean.view(1, -1, *([1] * (x.dim() - 2)))).square_().sum(dims) / values
    counts, means, variances = parts.gather(torch.stack([torch.full_like(mean, values), mean, var])).unbind(1)
    overall = (counts * means).sum(0) / total
    return overall, (counts * (variances + (means - overall).square())).sum(0) / total


class _SplitNorm(torch.autograd.Function):
    """Batch normalization with statistics over every part; returns the output, mean and variance.
    Forward and backward run the native kernels on the part, then correct the backward's per-channel
    sums, which the kernel takes over the part only, to every part's."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        total: float,
        eps: float,
        parts: _Parts,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean, var = _statistics(x, total, parts)
        out = F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x, weight, mean, torch.rsqrt(var + eps))
        ctx.total, ctx.eps, ctx.parts = total, eps, parts
        ctx.mark_non_differentiable(mean, var)
        return out, mean, var

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight, mean, invstd = ctx.saved_tensors
        grad_x, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
            grad.contiguous(), x, weight, None, None, mean, invstd, True, ctx.eps, [True, True, True]
        )
        # The kernel subtracts the part's means of grad and grad * normalized; every part's are due.
        local = x.numel() / x.shape[1]
        summed, summed_normalized = ctx.parts.gather(torch.stack([grad_bias, grad_weight])).sum(0)
        scale = invstd if weight is None else invstd * weight
        per_value = scale * (grad_bias / local - summed / ctx.total)
        per_normalized = scale * invstd * (grad_weight / local - summed_normalized / ctx.total)
        shape = [1, -1, *([1] * (x.dim() - 2))]
        # normalized = (x - mean) * invstd: add per_normalized * x and the rest per channel.
        grad_x.addcmul_(x, per_normalized.view(shape)).add_((per_value - per_normalized * mean).view(shape))
        wanted = ctx.needs_input_grad
        return (
            grad_x if wanted[0] else None,
            grad_weight if wanted[1] else None,
            grad_bias if wanted[2] else None,
            None,
            None,
            None,
        )
