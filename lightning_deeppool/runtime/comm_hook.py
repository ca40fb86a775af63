"""DDP communication hooks (`hook(state, bucket) -> Future[Tensor]`) applied to deeppool's gradient buckets.

DDP sums every bucket over its one process group, which a hook's state names (None: the world).
deeppool sums each bucket over the ranks that run its layers, so each call of the hook gets that
bucket's own group: as the state, where the state is None or a process group, else as the state's
``process_group``, set before the call (PowerSGD's state, say: one state, whose step count and
per-bucket memory serve every bucket, as in DDP). A hook averages over its group, as DDP's contract
has it; deeppool's gradients are averaged over the whole world (`grad_sync`), so a bucket summed by
fewer ranks is first scaled by group size / world size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

Hook = Callable[[Any, Any], torch.futures.Future[Any]]


@dataclass(frozen=True)
class CommHook:
    """A hook and its state, as `DistributedDataParallel.register_comm_hook(state, hook)` takes them."""

    hook: Hook
    state: object = None

    def over(self, groups: Mapping[tuple[int, ...], dist.ProcessGroup], world_size: int) -> HookedSums:
        """The hook applied to sums over the plan's `groups` (keyed by their sorted ranks)."""
        return HookedSums(self, groups, world_size)


class HookedSums:
    """Sums of gradient buckets, each through the hook with its group's state."""

    def __init__(
        self, comm_hook: CommHook, groups: Mapping[tuple[int, ...], dist.ProcessGroup], world_size: int
    ) -> None:
        self.comm_hook = comm_hook
        self.groups = groups
        self.world_size = world_size

    def sum(self, flat: torch.Tensor, ranks: Sequence[int], bucket: PlanGradBucket) -> HookResult:
        """Start replacing `flat` (this rank's undivided gradients, `bucket`'s buffer) by their average
        over the world, summed over `ranks` by the hook."""
        key = tuple(sorted(ranks))
        if len(key) != self.world_size:
            flat.mul_(len(key) / self.world_size)
        return HookResult(self.comm_hook.hook(self._state(key), bucket), flat)

    def _state(self, key: tuple[int, ...]) -> object:
        state = self.comm_hook.state
        group = self.groups[key]
        if state is None or isinstance(state, dist.ProcessGroup):
            return group
        if hasattr(state, "process_group"):
            state.process_group = group
        return state


class HookResult:
    """A hook's future; `wait` leaves its value in the bucket's flat gradients."""

    def __init__(self, future: torch.futures.Future[Any], flat: torch.Tensor) -> None:
        self.future = future
        self.flat = flat

    def wait(self) -> None:
        value = self.future.wait()
        result = value[0] if isinstance(value, list | tuple) else value
        if result.data_ptr() != self.flat.data_ptr():
            self.flat.copy_(result)


class PlanGradBucket:
    """What a hook reads of `dist.GradBucket`, for one of deeppool's buckets: `buffer` holds the
    gradients of `params`, in order, flat."""

    def __init__(self, index: int, buffer: torch.Tensor, params: Sequence[nn.Parameter], last: bool) -> None:
        self._index = index
        self._buffer = buffer
        self._params = list(params)
        self._last = last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def is_last(self) -> bool:
        """The last bucket this rank sums in a step (hooks such as PowerSGD count steps by it)."""
        return self._last

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient, a view of the buffer."""
        views, offset = [], 0
        for p in self._params:
            views.append(self._buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return views
