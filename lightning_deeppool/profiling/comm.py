"""Measured communication: alpha-beta fits of all-reduce per group size and of point-to-point moves."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_deeppool.comm.messages import GroupMessages, Messages, connect_local_links
from lightning_deeppool.ir.profile import AlphaBeta, CommProfile


def default_group_sizes(world_size: int) -> list[int]:
    """All-reduce group sizes worth measuring: 2..N up to 8 ranks, else powers of two and N."""
    if world_size <= 8:
        return list(range(2, world_size + 1))
    powers = [2**i for i in range(1, world_size.bit_length()) if 2**i < world_size]
    return [*powers, world_size]


def measure_comm(
    *,
    device: torch.device | str,
    sizes_bytes: Sequence[int] = (4096, 1 << 20, 4 << 20, 32 << 20),
    repeats: int = 3,
    group_sizes: Sequence[int] | None = None,
) -> CommProfile:
    """Collective: every rank calls it; every rank gets rank 0's measurement. The sizes reach a
    gradient bucket's (25 MB): small messages alone under-price large ones, which leave the caches.
    A move's latency is at least what a small exchange costs right after computing
    (`_between_computations`), as the moves of a step come.

    Without an initialized process group, or with one rank, returns `CommProfile()` (its defaults).
    Groups for sizes k < N are ranks 0..k-1, created and destroyed here in the same order everywhere.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return CommProfile()
    device = torch.device(device)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    sizes = sorted(set(group_sizes)) if group_sizes is not None else default_group_sizes(world_size)
    if not sizes or sizes[0] < 2 or sizes[-1] > world_size:
        raise ValueError(f"group sizes must be in 2..{world_size}, got {group_sizes}")
    if len(set(sizes_bytes)) < 2:
        raise ValueError(f"need at least two distinct message sizes to fit alpha-beta, got {sizes_bytes}")
    allreduce: dict[int, AlphaBeta] = {}
    for k in sizes:
        group = dist.new_group(list(range(k))) if k < world_size else None
        if rank < k:
            allreduce[k] = _fit(sizes_bytes, functools.partial(dist.all_reduce, group=group), repeats, device)
        if group is not None:
            dist.destroy_process_group(group)
    redistribute = halo = None
    # Spatial layers may exchange on links of their own: they get a model of them.
    links = connect_local_links(device)
    if rank < 2:
        fitted = _fit(sizes_bytes, _ping_pong(rank), repeats, device, scale=0.5)
        loaded = _between_computations(rank, device, GroupMessages(), repeats=max(repeats, 8))
        redistribute = AlphaBeta(max(fitted.latency_s, loaded), fitted.seconds_per_byte)
        if links is not None:
            loaded = _between_computations(rank, device, links, repeats=max(repeats, 8))
            halo = AlphaBeta(loaded, fitted.seconds_per_byte)
    if links is not None:
        links.close()
    result: list[Any] = [None]
    if redistribute is not None:  # rank 0 always measures it; the other ranks take rank 0's result
        result = [
            CommProfile(
                link=redistribute,
                allreduce=allreduce,
                redistribute=redistribute,
                measured=True,
                halo=halo,
                overlap=device.type != "cpu",
            )
        ]
    dist.broadcast_object_list(result, src=0, device=device if device.type == "cuda" else None)
    return result[0]


# Work before each exchange of `_between_computations`: a few layers' worth on a CPU.
COMPUTE_S = 3e-3


def _between_computations(rank: int, device: torch.device, messages: Messages, repeats: int) -> float:
    """Mean seconds of a small exchange between ranks 0 and 1 posted right after both computed, as a
    step's messages are. On a host whose cores are all busy computing, a process's first message
    after a stretch of work waits for its peer's communication thread to get a core: on a 2-core CPU
    machine that took 1-5 ms, against 50 us between idle ranks. Where devices compute (CUDA) the work
    is synchronized first and the exchange costs what it costs idle."""
    peer = 1 - rank
    work = torch.ones(128, 128, device=device)
    mine, theirs = torch.ones(256, device=device), torch.empty(256, device=device)
    times = []
    for _ in range(repeats + 1):
        deadline = time.perf_counter() + COMPUTE_S
        while time.perf_counter() < deadline:
            torch.mm(work, work)
        _sync(device)
        start = time.perf_counter()
        messages.post({peer: mine}, {peer: theirs}).wait()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.mean(times[1:])


def _ping_pong(rank: int) -> Callable[[torch.Tensor], None]:
    """Rank 0 sends to rank 1 and gets it back; half of the round trip is one move."""

    def exchange(buf: torch.Tensor) -> None:
        for p2p in (dist.isend, dist.irecv) if rank == 0 else (dist.irecv, dist.isend):
            work = p2p(buf, 1 - rank)
            if work is not None:
                work.wait()

    return exchange


def _fit(
    sizes_bytes: Sequence[int],
    op: Callable[[torch.Tensor], None],
    repeats: int,
    device: torch.device,
    scale: float = 1.0,
) -> AlphaBeta:
    """Median time of `op` per message size (after one warm-up) times `scale`, fitted to alpha-beta."""
    points = []
    for nbytes in sorted(set(sizes_bytes)):
        buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
        times = []
        for _ in range(repeats + 1):
            _sync(device)
            start = time.perf_counter()
            op(buf)
            _sync(device)
            times.append(time.perf_counter() - start)
        points.append((buf.numel() * 4, statistics.median(times[1:]) * scale))
    return fit_alpha_beta(points)


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> AlphaBeta:
    """Least squares of `seconds ~ latency + nbytes * seconds_per_byte`, both clamped >= 0.

    Residuals are relative (weighted by 1/seconds) so small messages pin down the latency.
    """
    nbytes = np.array([n for n, _ in points], dtype=float)
    seconds = np.array([s for _, s in points], dtype=float)
    weights = 1.0 / np.maximum(seconds, 1e-12)
    design = np.stack([weights, nbytes * weights], axis=1)
    (latency, per_byte), *_ = np.linalg.lstsq(design, seconds * weights, rcond=None)
    if latency < 0:
        latency = 0.0
        per_byte = float(np.sum(weights**2 * nbytes * seconds) / np.sum(weights**2 * nbytes**2))
    if per_byte < 0:
        per_byte = 0.0
        latency = float(np.sum(weights**2 * seconds) / np.sum(weights**2))
    return AlphaBeta(float(latency), float(per_byte))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
