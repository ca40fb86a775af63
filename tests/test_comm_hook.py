"""A DDP communication hook on deeppool's buckets: what it is given (the `GradBucket` API, the bucket's
group as its state) and what becomes of its result. One process: the hooks here do not communicate."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_deeppool.runtime.comm_hook import CommHook, PlanGradBucket

GROUPS: Any = {(0, 1): "group 0-1", (0, 1, 2): "group 0-1-2"}  # stand-ins: the hooks only note them


class PowerSGDLikeState:
    def __init__(self) -> None:
        self.process_group: Any = None


def _noting(seen: list[tuple[Any, torch.Tensor]]) -> Any:
    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        seen.append((state, bucket.buffer().clone()))
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer() * 10)
        return future

    return hook


def _sum(hook: CommHook, values: list[float], ranks: list[int], world_size: int) -> torch.Tensor:
    """`values` as a bucket's gradients, summed over `ranks` through `hook`: the bucket's result."""
    flat = torch.tensor(values)
    bucket = PlanGradBucket(0, flat, [nn.Parameter(torch.zeros(len(values)))], last=True)
    hook.over(GROUPS, world_size).sum(flat, ranks, bucket).wait()
    return flat


def test_the_hook_gets_the_buckets_group_and_over_the_world_ddps_undivided_gradients():
    seen: list[tuple[Any, torch.Tensor]] = []
    _sum(CommHook(_noting(seen)), [3.0, 6.0], [1, 0], 3)
    _sum(CommHook(_noting(seen)), [3.0, 6.0], [0, 1, 2], 3)
    assert [state for state, _ in seen] == ["group 0-1", "group 0-1-2"]
    assert torch.equal(seen[1][1], torch.tensor([3.0, 6.0]))


def test_a_bucket_of_part_of_the_world_is_scaled_by_group_size_over_world_size():
    seen: list[tuple[Any, torch.Tensor]] = []
    _sum(CommHook(_noting(seen)), [3.0, 6.0], [0, 1], 3)
    assert torch.allclose(seen[0][1], torch.tensor([2.0, 4.0]))


def test_the_hooks_result_replaces_the_buckets_gradients():
    assert torch.equal(_sum(CommHook(_noting([])), [1.0, 2.0], [0, 1], 2), torch.tensor([10.0, 20.0]))


def test_a_state_naming_a_process_group_names_each_buckets_group_when_the_hook_is_called():
    state = PowerSGDLikeState()
    groups: list[Any] = []

    def noting_group(state: PowerSGDLikeState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        groups.append(state.process_group)
        return _noting([])(state, bucket)

    for ranks in ([0, 1], [0, 1, 2], [0, 1]):
        _sum(CommHook(noting_group, state), [1.0], ranks, 3)
    assert groups == ["group 0-1", "group 0-1-2", "group 0-1"]


def test_a_bucket_offers_what_hooks_read_of_a_grad_bucket():
    params = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(4))]
    buffer = torch.arange(10.0)
    bucket = PlanGradBucket(3, buffer, params, last=False)
    weight, bias = bucket.gradients()
    assert (bucket.index(), bucket.is_last(), bucket.parameters()) == (3, False, params)
    assert weight.shape == (2, 3) and torch.equal(bias, torch.arange(6.0, 10.0))
    assert weight.data_ptr() == buffer.data_ptr()  # views of the buffer, as DDP's
    bucket.set_buffer(buffer.half())
    assert bucket.buffer().dtype == torch.float16
