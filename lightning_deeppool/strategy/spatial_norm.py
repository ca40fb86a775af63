"""BatchNorm on spatially split samples: the statistics are reduced over every part's rows, so a part
normalizes with the statistics one device would compute over the whole samples."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F


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
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """`F.batch_norm` for `local`, this part's rows of samples whose dimension `dim` (of `size` rows
    in all) is split over the parts of `group` (channels at dimension 1). In training, mean and
    variance come from every part (two differentiable all-reduces) and the running statistics are
    updated with them as one device would; in evaluation the running statistics are used as they are."""
    if not training:
        return F.batch_norm(local, running_mean, running_var, weight, bias, False, momentum, eps)
    dims = [0, *range(2, local.dim())]
    shape = [1, -1, *([1] * (local.dim() - 2))]
    # Values per channel over every part: known from the shapes, so no collective counts them.
    total = float(size * math.prod(n for i, n in enumerate(local.shape) if i not in (1, dim)))
    mean = _Sum.apply(local.sum(dims), group) / total
    centered = local - mean.view(shape)
    var = _Sum.apply(centered.square().sum(dims), group) / total
    out = centered * torch.rsqrt(var + eps).view(shape)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            running_mean.lerp_(mean.to(running_mean.dtype), momentum)
            unbiased = var * (total / max(total - 1.0, 1.0))
            running_var.lerp_(unbiased.to(running_var.dtype), momentum)
    return out


class _Sum(torch.autograd.Function):
    """Sum over the group's ranks; its gradient is the sum of theirs (every rank used the sum)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        total = local.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None
