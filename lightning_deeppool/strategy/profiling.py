"""Profiling across ranks: every rank times its share of the layers, rank 0 caches the result.

Collective: every rank calls `profile_on_ranks` at the same point with the same graph. A failure on
one rank (out of memory while timing, say) stops every rank (see `agree`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_deeppool.capture import CapturedGraph
from lightning_deeppool.planner.cache import load_cached_profile, profile_cache_key, save_cached_profile
from lightning_deeppool.planner.cost import per_device_batch
from lightning_deeppool.planner.profile import Profile
from lightning_deeppool.planner.profiler import (
    assign_layers,
    candidate_batch_sizes,
    merge_layer_profiles,
    profile_layers,
    time_optimizer_step,
    time_whole_model,
)
from lightning_deeppool.strategy.agree import on_every_rank, on_rank_zero
from lightning_deeppool.strategy.measure import measure_comm


def profile_on_ranks(
    captured: CapturedGraph,
    env: dict[str, Any],
    global_batch_size: int,
    *,
    device: torch.device,
    optimizers: Sequence[torch.optim.Optimizer],
    cache_dir: Path | None,
    warmup: int,
    repeats: int,
) -> Profile:
    """The profile for this graph, batch and world: from `cache_dir` if there, else measured (layer
    times split over ranks and merged, communication on this process group, the optimizer update on
    rank 0) and written there by rank 0."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    graph = captured.graph
    device_name = _device_name(device)
    dtype = str(next((p.dtype for p in captured.module.parameters()), torch.float32))
    inputs = {name: repr(captured.meta[name].leaves) for name in captured.batch_inputs}
    key = profile_cache_key(graph.fingerprint, inputs, dtype, device_name, world_size, global_batch_size)
    cached = on_rank_zero(lambda: load_cached_profile(cache_dir, key) if cache_dir else None)
    if cached is not None:
        rank_zero_info(f"deeppool: using the cached profile {key} from {cache_dir}")
        return cached
    sizes = candidate_batch_sizes(global_batch_size, world_size)
    mine = assign_layers([layer.name for layer in graph.layers], world_size, rank)
    part = on_every_rank(
        lambda: profile_layers(
            captured,
            env,
            sizes,
            layers=mine,
            warmup=warmup,
            repeats=repeats,
            device=device,
            progress=_progress_printer() if rank == 0 else None,
        )
    )
    parts: list[Any] = [None] * world_size
    dist.all_gather_object(parts, part)
    # Every rank times a whole pass at the same time, as data parallelism would run it.
    batch = per_device_batch(global_batch_size, world_size)
    whole = on_every_rank(
        lambda: time_whole_model(captured, env, batch, warmup=warmup, repeats=repeats, device=device)
    )
    wholes: list[Any] = [None] * world_size
    dist.all_gather_object(wholes, whole)
    profile = Profile(
        graph_fingerprint=graph.fingerprint,
        device=device_name,
        dtype=dtype,
        layers=merge_layer_profiles(parts),
        comm=measure_comm(device=device),
        optimizer_s=on_rank_zero(lambda: time_optimizer_step(optimizers)),
    ).calibrated(statistics.mean(wholes), batch)
    if cache_dir is not None and rank == 0:
        save_cached_profile(cache_dir, key, profile)
    return profile


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{torch.get_num_threads()}threads"


def _progress_printer() -> Callable[[int, int], None]:
    def progress(done: int, total: int) -> None:
        end = "\n" if done == total else "\r"
        print(f"deeppool: profiling layers {done}/{total}", end=end, flush=True)

    return progress
