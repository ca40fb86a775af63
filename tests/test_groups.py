"""Process groups of a plan: built on every rank, one per set of ranks that sums gradients."""

import pytest
import torch
import torch.distributed as dist

from lightning_deeppool.comm.groups import PlanGroups

from distributed import run_distributed

pytestmark = pytest.mark.floors


def _build(rank: int) -> dict[tuple[int, ...], float]:
    groups = PlanGroups([(0,), (0, 1), (0, 1, 2), (1, 2), (0, 1)], 3)
    sums = {}
    for ranks in groups:
        if rank in ranks:
            t = torch.full((1,), float(rank + 1))
            dist.all_reduce(t, group=groups[ranks])
            sums[ranks] = t.item()
    groups.destroy()
    return sums


def test_every_set_of_more_than_one_rank_gets_a_group_of_those_ranks():
    assert run_distributed(_build, 3) == [
        {(0, 1): 3.0, (0, 1, 2): 6.0},
        {(0, 1): 3.0, (1, 2): 5.0, (0, 1, 2): 6.0},
        {(1, 2): 5.0, (0, 1, 2): 6.0},
    ]
