"""Profiling across ranks: every rank times its share of the layers, rank 0 caches the result.

Collective: every rank calls `profile_on_ranks` at the same point with the same graph. A failure on
one rank (out of memory while timing, say) stops every rank (see `comm.fail_together`).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_deeppool.capture import CapturedGraph
from lightning_deeppool.comm.fail_together import on_every_rank, on_rank_zero
from lightning_deeppool.ir.buckets import cut_into_buckets
from lightning_deeppool.ir.placement import per_device_batch
from lightning_deeppool.ir.profile import CommProfile, LayerProfile, Profile
from lightning_deeppool.profiling.cache import load_cached_profile, profile_cache_key, save_cached_profile
from lightning_deeppool.profiling.comm import measure_comm
from lightning_deeppool.profiling.layers import (
    assign_layers,
    candidate_batch_sizes,
    device_name,
    measure_optimizer_step,
    merge_layer_profiles,
    parameter_dtype,
    profile_layers,
    progress_printer,
    time_whole_model,
)


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
    measured_on, dtype = device_name(device), parameter_dtype(captured.module)
    key = _cache_key(captured, measured_on, dtype, global_batch_size)
    cached = _load_cached(cache_dir, key)
    if cached is not None:
        return cached
    world_size = dist.get_world_size()
    sizes = candidate_batch_sizes(global_batch_size, world_size)
    layers = _time_layers(captured, env, sizes, device=device, warmup=warmup, repeats=repeats)
    comm = measure_comm(device=device)
    batch = per_device_batch(global_batch_size, world_size)
    plain, reduced = _time_whole_passes(
        captured, env, batch, comm.bucket_bytes, device=device, warmup=warmup, repeats=repeats
    )
    update = on_rank_zero(lambda: measure_optimizer_step(optimizers))
    profile = Profile(
        graph_fingerprint=captured.graph.fingerprint,
        device=measured_on,
        dtype=dtype,
        layers=layers,
        comm=_calibrated_comm(comm, captured.module, plain, reduced),
        optimizer_s=update.seconds,
        optimizer_states=update.states,
    ).calibrated(plain, batch)
    if cache_dir is not None and dist.get_rank() == 0:
        save_cached_profile(cache_dir, key, profile)
    return profile


def _cache_key(captured: CapturedGraph, measured_on: str, dtype: str, global_batch_size: int) -> str:
    """The cache key of this graph's profile in this world (`profile_cache_key`)."""
    inputs = {name: repr(captured.meta[name].leaves) for name in captured.batch_inputs}
    fingerprint, world_size = captured.graph.fingerprint, dist.get_world_size()
    return profile_cache_key(fingerprint, inputs, dtype, measured_on, world_size, global_batch_size)


def _load_cached(cache_dir: Path | None, key: str) -> Profile | None:
    """Rank 0's cached profile under `key` (None without one), on every rank; collective."""
    cached = on_rank_zero(lambda: load_cached_profile(cache_dir, key) if cache_dir else None)
    if cached is not None and dist.get_rank() == 0:
        print(f"deeppool: using the cached profile {key} from {cache_dir}", flush=True)
    return cached


def _time_layers(
    captured: CapturedGraph,
    env: dict[str, Any],
    sizes: Sequence[int],
    *,
    device: torch.device,
    warmup: int,
    repeats: int,
) -> dict[str, LayerProfile]:
    """Every layer's times at `sizes`, each rank timing its share (`assign_layers`), merged on every
    rank; collective."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = assign_layers([layer.name for layer in captured.graph.layers], world_size, rank)
    part = on_every_rank(
        lambda: profile_layers(
            captured,
            env,
            sizes,
            layers=mine,
            warmup=warmup,
            repeats=repeats,
            device=device,
            progress=progress_printer("deeppool: ") if rank == 0 else None,
        )
    )
    parts: list[Any] = [None] * world_size
    dist.all_gather_object(parts, part)
    return merge_layer_profiles(parts)


def _time_whole_passes(
    captured: CapturedGraph,
    env: dict[str, Any],
    batch: int,
    bucket_bytes: int,
    *,
    device: torch.device,
    warmup: int,
    repeats: int,
) -> tuple[float, float]:
    """Seconds of a whole pass at `batch`, without and then with the all-reduce of its gradients,
    each averaged over ranks; collective. Every rank times them at the same time, as data
    parallelism runs them."""

    def whole(reduce: Callable[[list[torch.Tensor]], None] | None) -> float:
        return _mean_over_ranks(
            lambda: time_whole_model(
                captured, env, batch, warmup=warmup, repeats=repeats, device=device, reduce=reduce
            )
        )

    return whole(None), whole(functools.partial(_all_reduce_in_buckets, bucket_bytes=bucket_bytes))


def _calibrated_comm(comm: CommProfile, module: torch.nn.Module, plain: float, reduced: float) -> CommProfile:
    """`comm` fitted to what all-reducing the module's gradients added to a `plain` whole pass."""
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return comm.calibrated(reduced - plain, dist.get_world_size(), grad_bytes, plain)


def _mean_over_ranks(measure: Callable[[], float]) -> float:
    """Every rank's measurement (taken at the same time), averaged; collective."""
    mine = on_every_rank(measure)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return statistics.mean(every)


def _all_reduce_in_buckets(grads: list[torch.Tensor], bucket_bytes: int) -> None:
    """All-reduce gradients in buckets cut as the runtime cuts them (`buckets.cut_into_buckets`), in
    reverse order as backward meets them, a bucket of one gradient in place; launched together, then
    waited for."""
    sized = [(grad, grad.numel() * grad.element_size()) for grad in reversed(grads)]
    buckets = cut_into_buckets(sized, bucket_bytes, first=True)
    works = [dist.all_reduce(_flat(bucket), async_op=True) for bucket in buckets]
    for work in works:
        if work is not None:
            work.wait()


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradients as one flat tensor: a view of a lone one, else a concatenated copy."""
    return grads[0].reshape(-1) if len(grads) == 1 else torch.cat([g.reshape(-1) for g in grads])
