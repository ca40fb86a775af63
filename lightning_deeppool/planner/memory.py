"""Memory per rank of a plan, estimated from sizes in the layer graph (not measured).

A rank holds the parameters of the layers it runs, each with its gradient and `optimizer_states`
more copies (optimizer state: 1 for SGD with momentum, the default; 0 for plain SGD; 2 for Adam);
rank 0, which updates every parameter, holds every one. A parameter several layers use (`Tied`) is
held once by every rank that runs one of its users. Activations kept for backward: each layer's
output (`Layer.sample_bytes`) for the samples the rank holds at that layer, times the share of each
sample a part holds where samples are split by height. Workspace, the allocator's slack and the
framework's own memory are not counted.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning_deeppool.ir.graph import LayerGraph
from lightning_deeppool.ir.placement import Layout, Placement
from lightning_deeppool.planner.cost import row_share

DEFAULT_OPTIMIZER_STATES = 1  # SGD with momentum: one momentum buffer per parameter


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
    graph: LayerGraph, placements: Mapping[str, Placement], *, world_size: int, global_batch_size: int
) -> list[int]:
    """Bytes of layer outputs each rank keeps for backward: per layer, its samples at that layer
    times `sample_bytes`, times the share of each sample it holds when split by height."""
    kept = [0.0] * world_size
    for layer in graph.layers:
        placement = placements[layer.name]
        layout = Layout.of(placement, global_batch_size, world_size)
        share = row_share(layer, placement.spatial)
        for rank in placement.ranks:
            kept[rank] += layout.samples(rank) * layer.sample_bytes * share
    return [round(value) for value in kept]


def memory_per_rank(
    graph: LayerGraph,
    placements: Mapping[str, int | Placement],
    *,
    world_size: int,
    global_batch_size: int,
    optimizer_states: int = DEFAULT_OPTIMIZER_STATES,
) -> tuple[int, ...]:
    """Estimated peak bytes per rank: held parameters times (1 parameter + 1 gradient +
    `optimizer_states`), plus the activations kept for backward (see the module docstring)."""
    if optimizer_states < 0:
        raise ValueError(f"optimizer_states must be >= 0, got {optimizer_states}")
    found = {name: Placement.of(value) for name, value in placements.items()}
    params = held_param_bytes(graph, found, world_size)
    kept = activation_bytes(graph, found, world_size=world_size, global_batch_size=global_batch_size)
    return tuple(p * (2 + optimizer_states) + a for p, a in zip(params, kept, strict=True))


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
