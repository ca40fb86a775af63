"""Memory per rank of a plan, estimated from the layer graph's sizes and the profile's activations.

A rank holds the parameters of the layers it runs, each with its gradient and `optimizer_states`
bytes of optimizer state per parameter byte (the profile's, measured on the user's optimizers; 1, SGD
with momentum, without a profile); rank 0, which updates every parameter, holds every one. A
parameter several layers use (`Tied`) is held once by every rank that runs one of its users.
Activations kept for backward: each layer's profiled `activation_bytes` per sample (its output's
`Layer.sample_bytes` where the profile has none) for the samples the rank holds at that layer, times
the share of each sample a part holds where samples are split by height; and the copy of each input
a layer receives from another placement (or pads with its neighbours' rows), which the layer may
keep for its backward as it would keep its input. Workspace, the allocator's slack and the
framework's own memory are not counted.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from lightning_deeppool.ir.graph import Layer, LayerGraph
from lightning_deeppool.ir.placement import Layout, Placement, per_device_batch
from lightning_deeppool.ir.profile import Profile
from lightning_deeppool.planner.cost import halo_share

DEFAULT_OPTIMIZER_STATES = 1.0  # SGD with momentum: one momentum buffer per parameter


def per_sample_activations(layer: Layer, profile: Profile | None, batches: np.ndarray) -> np.ndarray:
    """Bytes per sample the layer keeps for backward at each per-device batch in `batches`: the
    profile's `activation_bytes` interpolated (clamped to its range), else its output's bytes."""
    measured = None if profile is None else profile.layer(layer.name)
    if measured is None or measured.activation_bytes is None:
        return np.full(len(batches), float(layer.sample_bytes))
    sizes = np.asarray(measured.batch_sizes)
    return np.interp(batches, sizes, np.asarray(measured.activation_bytes) / sizes)


def optimizer_states(profile: Profile | None) -> float:
    """Optimizer-state bytes per parameter byte: the profile's, else SGD with momentum's."""
    return DEFAULT_OPTIMIZER_STATES if profile is None else profile.optimizer_states


def held_bytes(param_bytes: float, profile: Profile | None) -> float:
    """Bytes of parameters held for training: each with its gradient and `optimizer_states`."""
    return param_bytes * (2 + optimizer_states(profile))


def held_param_bytes(graph: LayerGraph, placements: Mapping[str, Placement], world_size: int) -> list[int]:
    """Parameter bytes each rank holds: those of the layers it runs, a tied parameter once; every
    parameter on rank 0."""
    tied_at_first_user: dict[str, int] = {}
    for tied in graph.tied:
        tied_at_first_user[tied.users[0]] = tied_at_first_user.get(tied.users[0], 0) + tied.param_bytes
    held = [0] * world_size
    for layer in graph.layers:
        own = layer.param_bytes - tied_at_first_user.get(layer.name, 0)
        for rank in placements[layer.name].ranks:
            held[rank] += own
    for tied in graph.tied:
        for rank in set().union(*(placements[user].ranks for user in tied.users)):
            held[rank] += tied.param_bytes
    held[0] = sum(layer.param_bytes for layer in graph.layers)
    return held


def activation_bytes(
    graph: LayerGraph,
    placements: Mapping[str, Placement],
    *,
    world_size: int,
    global_batch_size: int,
    profile: Profile | None = None,
) -> list[int]:
    """Bytes each rank keeps for backward: per layer, its samples at that layer times the layer's
    bytes per sample (`per_sample_activations`) and those of the input copies it keeps
    (`_kept_copies`), times the share of each sample the rank holds when split by height (`_part`)."""
    kept = [0.0] * world_size
    for layer in graph.layers:
        placement = placements[layer.name]
        layout = Layout.of(placement, global_batch_size, world_size)
        batch = per_device_batch(global_batch_size, placement.groups)
        halo = halo_share(graph, layer)
        copied = [
            name
            for name in dict.fromkeys(layer.inputs)
            if _copied(graph, placements, name, placement, halo, world_size)
        ]
        activations = float(per_sample_activations(layer, profile, np.array([batch]))[0])
        copies = _kept_copies(graph, layer, profile, batch, copied)
        for rank in placement.ranks:
            rows, with_halo = _part(layout, rank, layer, halo)
            kept[rank] += layout.samples(rank) * (activations * rows + copies * with_halo)
    return [round(value) for value in kept]


def _part(layout: Layout, rank: int, layer: Layer, halo: float) -> tuple[float, float]:
    """The share of each sample `rank` holds of the layer's rows, without and with the halo it reads
    (half of `halo` from each neighbouring part): (1, 1) unsplit."""
    if layout.spatial == 1:
        return 1.0, 1.0
    rows = layout.block(rank, layer.height).rows / layer.height
    _, index = layout.part(rank)
    neighbours = (index > 0) + (index < layout.spatial - 1)
    return rows, min(1.0, rows + halo * neighbours / 2)


def _kept_copies(
    graph: LayerGraph, layer: Layer, profile: Profile | None, batch: int, copied: list[str]
) -> float:
    """Bytes per sample of the `copied` inputs the layer keeps for backward: their share of the input
    bytes it saves where profiled (`LayerProfile.saved_input_bytes`), else all of them."""
    if not copied:
        return 0.0
    copies = sum(graph.value_sample_bytes(name) for name in copied)
    measured = None if profile is None else profile.layer(layer.name)
    if measured is None or measured.saved_input_bytes is None:
        return float(copies)
    inputs = sum(graph.value_sample_bytes(name) for name in dict.fromkeys(layer.inputs))
    sizes = np.asarray(measured.batch_sizes)
    saved = float(np.interp(batch, sizes, np.asarray(measured.saved_input_bytes) / sizes))
    return saved * copies / inputs if inputs else 0.0


def _copied(
    graph: LayerGraph,
    placements: Mapping[str, Placement],
    name: str,
    placement: Placement,
    halo: float,
    world_size: int,
) -> bool:
    """Whether a layer at `placement` runs on a copy of input `name`: made where it comes from another
    placement (graph inputs are at full width), or padded with the halo a split reads."""
    source = placements[name] if graph.position(name) >= 0 else Placement(world_size)
    return source != placement or (placement.spatial > 1 and halo > 0)


def memory_per_rank(
    graph: LayerGraph,
    placements: Mapping[str, int | Placement],
    *,
    world_size: int,
    global_batch_size: int,
    profile: Profile | None = None,
) -> tuple[int, ...]:
    """Estimated peak bytes per rank: held parameters times (1 parameter + 1 gradient +
    `optimizer_states`), plus the activations kept for backward (see the module docstring)."""
    found = {name: Placement.of(value) for name, value in placements.items()}
    params = held_param_bytes(graph, found, world_size)
    kept = activation_bytes(
        graph, found, world_size=world_size, global_batch_size=global_batch_size, profile=profile
    )
    return tuple(round(held_bytes(p, profile)) + a for p, a in zip(params, kept, strict=True))


def summary(memory: tuple[int, ...]) -> str:
    """``r0 48.1 MB, r1-3 2.3 MB`` (MB: 10^6 bytes), consecutive ranks alike grouped."""
    return by_rank([f"{value / 1e6:.1f} MB" for value in memory])


def by_rank(texts: list[str]) -> str:
    """``r0 a, r1-3 b``: one text per rank, consecutive ranks with the same text grouped."""
    parts, start = [], 0
    for rank in range(1, len(texts) + 1):
        if rank == len(texts) or texts[rank] != texts[start]:
            ranks = f"r{start}" if rank - 1 == start else f"r{start}-{rank - 1}"
            parts.append(f"{ranks} {texts[start]}")
            start = rank
    return ", ".join(parts)
