"""Where the jobs go: each rank's idle share, gathered once (the callback's one collective), and a
round-robin from the highest rank down over the ranks with enough of it."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch.distributed as dist

from lightning_deeppool.background.job import BackgroundJob
from lightning_deeppool.planner.plan import Plan


def idle_share(*, cuda: bool, plan: Plan | None, rank: int, warmup_idle: Sequence[float]) -> float:
    """A rank's idle share of a step. On CPU, measured: the median over the warm-up steps of the
    share spent in idle windows (one step a peer was late must not count). On CUDA the host does
    not wait for its peers (collectives are queued on streams), so it is the installed plan's share
    of compute time during which the rank runs no layer. 0 without either."""
    if cuda:
        return plan.idle_fractions()[rank] if plan is not None else 0.0
    return statistics.median(warmup_idle) if warmup_idle else 0.0


def gather_idle_shares(share: float, world_size: int) -> list[float]:
    """Every rank's idle share, in rank order (collective when the process group is up)."""
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [share]
    shares = [0.0] * world_size
    dist.all_gather_object(shares, share)
    return shares


def assign_jobs(
    jobs: list[BackgroundJob], idle_fractions: Sequence[float], min_idle_fraction: float
) -> dict[int, list[BackgroundJob]]:
    """Pinned jobs go to their rank; the others round-robin from the highest rank down (in a burst
    plan the high ranks run the fewest layers) over the ranks whose idle fraction is at least
    `min_idle_fraction`, or over every rank when none is."""
    world_size = len(idle_fractions)
    placed: dict[int, list[BackgroundJob]] = {rank: [] for rank in range(world_size)}
    descending = list(range(world_size - 1, -1, -1))
    order = [rank for rank in descending if idle_fractions[rank] >= min_idle_fraction] or descending
    check_pins(jobs, world_size)
    unpinned = 0
    for job in jobs:
        if job.rank is not None:
            placed[job.rank].append(job)
        else:
            placed[order[unpinned % len(order)]].append(job)
            unpinned += 1
    return placed


def format_placement(
    placed: dict[int, list[BackgroundJob]], idle_fractions: Sequence[float], mode: str
) -> str:
    """One line per rank: its idle fraction and the jobs placed on it."""
    lines = [f"background jobs placed (mode {mode}):"]
    for rank in sorted(placed):
        names = ", ".join(str(job.name) for job in placed[rank]) or "-"
        lines.append(f"  rank {rank} (idle {idle_fractions[rank]:.0%}): {names}")
    return "\n".join(lines)


def check_pins(jobs: list[BackgroundJob], world_size: int) -> None:
    for job in jobs:
        if job.rank is not None and job.rank >= world_size:
            raise ValueError(
                f"background job {job.name!r} is pinned to rank {job.rank}, but the foreground has "
                f"{world_size} ranks (0..{world_size - 1})"
            )
