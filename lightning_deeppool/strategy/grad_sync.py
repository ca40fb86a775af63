"""Gradient synchronisation: each bucket is all-reduced only among its owners, asynchronously.

Gradients are divided by the world size before the sum, as DDP does: with each rank's loss a mean
over its own samples, the result equals DDP's averaged gradient on every owner.

Buckets launch as soon as their gradients are final (a post-accumulate hook per parameter), so the
all-reduce overlaps the rest of the backward, but always in the schedule's bucket order: every
member issues the same collectives in the same sequence. The schedule's `sync` action launches
whatever is still pending at the point where the bucket is final for certain.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_deeppool.strategy.schedule import Bucket


class GradSync:
    """Launches this rank's bucket all-reduces during backward and finishes them at the end.

    `buckets` are the buckets this rank is a member of, in schedule order; `local` the parameters
    only this rank owns (divided, never reduced); `unplanned` those outside the traced graph,
    averaged over all ranks at the end, as DDP would. `uses` counts how many layers use each
    parameter: one used more than once is only final at its schedule `sync`, not at its first hook.
    """

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        groups: Mapping[int, dist.ProcessGroup],
        world_size: int,
        buckets: Sequence[Bucket],
        *,
        local: Sequence[str] = (),
        unplanned: Sequence[str] = (),
        uses: Mapping[str, int] | None = None,
        waiting: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        self.params = params
        self.groups = groups
        self.world_size = world_size
        self.buckets = list(buckets)
        self.local = list(local)
        self.unplanned = list(unplanned)
        self.waiting = waiting
        self.enabled = True
        self._position = {bucket.index: i for i, bucket in enumerate(self.buckets)}
        self._missing: list[int] = []
        self._next = 0
        self._pending: list[tuple[dist.Work, torch.Tensor, list[nn.Parameter]]] = []
        uses = uses or {}
        hooked = [[name for name in bucket.params if uses.get(name, 1) == 1] for bucket in self.buckets]
        self._hooks = [
            self.params[name].register_post_accumulate_grad_hook(self._hook(i))
            for i, names in enumerate(hooked)
            for name in names
        ]
        # A bucket with a shared parameter also waits for one more event: its schedule `sync`.
        self._expected = [
            len(names) + (len(names) < len(bucket.params)) for names, bucket in zip(hooked, self.buckets)
        ]

    def begin(self) -> None:
        """Start a backward pass: nothing is final yet."""
        self._missing = list(self._expected)
        self._next = 0

    def _hook(self, position: int) -> Callable[[Any], None]:
        def on_final(_: Any) -> None:
            if not self.enabled or not self._missing:
                return
            self._missing[position] -= 1
            self._launch_ready()

        return on_final

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._launch_next()

    def launch_through(self, bucket: Bucket) -> None:
        """The schedule's `sync`: launch every bucket up to this one that is not launched yet."""
        if not self.enabled or bucket.index not in self._position:
            return
        while self._next <= self._position[bucket.index]:
            self._launch_next()

    def _launch_next(self) -> None:
        """Launch the next bucket in schedule order: the only way buckets are launched."""
        self._launch(self.buckets[self._next])
        self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        tensors = [self.params[name] for name in bucket.params]
        for p in tensors:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in tensors if p.grad is not None]
        # A lone contiguous gradient is reduced in place: large parameters get their own bucket,
        # and copying tens of megabytes in and out costs as much as the all-reduce itself.
        alone = len(grads) == 1 and grads[0].is_contiguous()
        flat = grads[0].view(-1) if alone else torch.cat([g.reshape(-1) for g in grads])
        flat.div_(self.world_size)
        work = dist.all_reduce(flat, group=self.groups[bucket.width], async_op=True)
        assert work is not None
        self._pending.append((work, flat, tensors))

    def finish(self) -> None:
        """Wait for every launched bucket and scale the gradients that were not all-reduced."""
        if not self.enabled:
            return
        if self.unplanned and self.world_size > 1:
            self._launch(Bucket(-1, self.world_size, tuple(self.unplanned)))
        for name in self.local:
            grad = self.params[name].grad
            if grad is not None:
                grad.div_(self.world_size)
        for work, flat, tensors in self._pending:
            with self.waiting():
                work.wait()
            offset = 0
            for p in tensors:
                n = p.numel()
                assert p.grad is not None
                if p.grad.data_ptr() != flat.data_ptr():
                    p.grad.copy_(flat[offset : offset + n].view_as(p))
                offset += n
        self._pending.clear()
        self._missing = []

    def close(self) -> None:
        """Remove the gradient hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
