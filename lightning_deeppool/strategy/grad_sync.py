"""Gradient synchronisation: each bucket is all-reduced only among its owners, asynchronously.

Gradients are divided by the world size before the sum, as DDP does: with each rank's loss a mean
over its own samples, the result equals DDP's averaged gradient on every owner.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lightning_deeppool.strategy.schedule import Bucket


@dataclass
class GradSync:
    """Launches bucket all-reduces during backward and finishes them at the end."""

    params: Mapping[str, nn.Parameter]
    groups: Mapping[int, dist.ProcessGroup]
    world_size: int
    local_params: Sequence[str]
    unplanned: Sequence[str] = ()
    waiting: Callable[[], AbstractContextManager[None]] = nullcontext
    _pending: list[tuple[dist.Work, torch.Tensor, list[nn.Parameter]]] = field(default_factory=list)

    def launch(self, bucket: Bucket) -> None:
        """Start the all-reduce of one bucket among ranks 0..bucket.width-1 (members only)."""
        tensors = [self.params[name] for name in bucket.params]
        for p in tensors:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in tensors])
        flat.div_(self.world_size)
        work = dist.all_reduce(flat, group=self.groups[bucket.width], async_op=True)
        self._pending.append((work, flat, tensors))

    def finish(self) -> None:
        """Wait for every launched bucket and scale the gradients that were not all-reduced.

        Parameters outside the traced graph (used directly in training_step) are averaged over all
        ranks, as DDP would.
        """
        if self.unplanned and self.world_size > 1:
            self.launch(Bucket(-1, self.world_size, tuple(self.unplanned)))
        for name in self.local_params:
            grad = self.params[name].grad
            if grad is not None:
                grad.div_(self.world_size)
        for work, flat, tensors in self._pending:
            with self.waiting():
                work.wait()
            offset = 0
            for p in tensors:
                assert p.grad is not None
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        self._pending.clear()
