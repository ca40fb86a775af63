"""BatchNorm on spatially split samples: the statistics are reduced over every part's rows, so a part
normalizes with the statistics one device would compute over the whole samples."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_reduce
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
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """`F.batch_norm` for `local`, this part's rows of samples split over the parts of `group`
    (channels at dimension 1). In training, mean and variance come from every part (two
    differentiable all-reduces) and the running statistics are updated with them as one device
    would; in evaluation the running statistics are used as they are."""
    if not training:
        return F.batch_norm(local, running_mean, running_var, weight, bias, False, momentum, eps)
    dims = [0, *range(2, local.dim())]
    shape = [1, -1, *([1] * (local.dim() - 2))]
    count = torch.tensor([local.numel() // max(local.shape[1], 1)], dtype=torch.float64, device=local.device)
    dist.all_reduce(count, group=group)
    total = float(count.item())
    mean = all_reduce(local.sum(dims), group=group) / total
    centered = local - mean.view(shape)
    var = all_reduce(centered.square().sum(dims), group=group) / total
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
