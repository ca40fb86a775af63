"""BatchNorm on spatially split samples: the statistics are reduced over every part's rows, so a part
normalizes with the statistics one device would compute over the whole samples."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn import functional as F

from lightning_deeppool.spatial.part import SpatialPart


def split_batch_norm(
    mine: torch.Tensor,
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
    part: SpatialPart,
) -> torch.Tensor:
    """`F.batch_norm` for `mine`, `part`'s rows of samples whose dimension `dim` (of `size` rows in
    all) is split over the parts (channels at dimension 1). In training, mean and variance come from
    every part (exchanged) and the running statistics are updated with them as one device would; in
    evaluation the running statistics are used as they are. Saves only its input for backward, as
    the native BatchNorm does."""
    if not training:
        return F.batch_norm(mine, running_mean, running_var, weight, bias, False, momentum, eps)
    # Values per channel over every part: known from the shapes, so no collective counts them.
    total = float(size * math.prod(n for i, n in enumerate(mine.shape) if i not in (1, dim)))
    out, mean, var = _SplitNorm.apply(mine, weight, bias, total, eps, part)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            running_mean.lerp_(mean.to(running_mean.dtype), momentum)
            unbiased = var * (total / max(total - 1.0, 1.0))
            running_var.lerp_(unbiased.to(running_var.dtype), momentum)
    return out


def _statistics(x: torch.Tensor, total: float, part: SpatialPart) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, the mean and (biased) variance over every part's values: each part's own, combined
    exactly (Chan et al.'s pairwise formula, no cancellation) after one exchange."""
    dims, values = [0, *range(2, x.dim())], x.numel() / x.shape[1]
    # In at least float32 (as the native kernel accumulates), in two passes (torch.var_mean is several
    # times slower here on CPU).
    exact = torch.promote_types(x.dtype, torch.float32)
    mean = x.sum(dims, dtype=exact) / values
    var = torch.sub(x, mean.view(1, -1, *([1] * (x.dim() - 2)))).square_().sum(dims) / values
    counts, means, variances = part.gather(torch.stack([torch.full_like(mean, values), mean, var])).unbind(1)
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
        part: SpatialPart,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean, var = _statistics(x, total, part)
        out = F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x, weight, mean, torch.rsqrt(var + eps))
        ctx.total, ctx.eps, ctx.part = total, eps, part
        ctx.mark_non_differentiable(mean, var)
        return out, mean, var

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight, mean, invstd = ctx.saved_tensors
        grad_x, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
            grad.contiguous(), x, weight, None, None, mean, invstd, True, ctx.eps, [True, True, True]
        )
        # The kernel subtracts the part's means of grad and grad * normalized; every part's are due.
        values = x.numel() / x.shape[1]
        summed, summed_normalized = ctx.part.gather(torch.stack([grad_bias, grad_weight])).sum(0)
        scale = invstd if weight is None else invstd * weight
        per_value = scale * (grad_bias / values - summed / ctx.total)
        per_normalized = scale * invstd * (grad_weight / values - summed_normalized / ctx.total)
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
