"""Process groups of a plan: built on every rank, one per width, of ranks 0..width-1."""

import torch
import torch.distributed as dist

from lightning_deeppool.comm.groups import PlanGroups

from distributed import run_distributed


def _build(rank: int) -> dict[int, float]:
    groups = PlanGroups([1, 2, 3, 2], 3)
    sums = {}
    for width in groups:
        if rank < width:
            t = torch.ones(1)
            dist.all_reduce(t, group=groups[width])
            sums[width] = t.item()
    groups.destroy()
    return sums


def test_every_width_above_one_gets_a_group_of_ranks_zero_to_width():
    assert run_distributed(_build, 3) == [{2: 2.0, 3: 3.0}, {2: 2.0, 3: 3.0}, {3: 3.0}]
