"""The cost model: predicted seconds of one training step for a width assignment. Pure functions, no torch.

A step costs, per layer: compute (profiled fwd+bwd time at the per-device batch ``ceil(B / w)``),
sync (all-reduce of its gradients among its ``w`` devices) and transfer (redistributing activations
forward and their gradients backward on every edge whose ends have different widths). Graph inputs and
outputs live at width N. An edge's transfer is charged to the consuming layer; the return of a graph
output to width N is charged to the layer that produces it. A parameter several layers share is
all-reduced once, among the devices of its widest user, and charged there (`synced_bytes`); the
search's dynamic programme, which sees one layer at a time, charges it to its first user instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from lightning_deeppool.planner.graph import Layer, LayerGraph
from lightning_deeppool.planner.profile import CommProfile, Profile

# Forward activations plus backward gradients: every redistribution happens twice per step.
DIRECTIONS = 2


@dataclass(frozen=True)
class LayerCost:
    """Predicted seconds of one layer at its width."""

    compute_s: float
    sync_s: float
    transfer_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.sync_s + self.transfer_s


@dataclass(frozen=True)
class StepCost:
    """Per-layer costs (execution order) and their sum, the predicted step time."""

    layers: dict[str, LayerCost]

    @property
    def total_s(self) -> float:
        return sum(cost.total_s for cost in self.layers.values())


def check_sizes(world_size: int, global_batch_size: int) -> None:
    """Raise ValueError unless every rank of the world can hold at least one sample."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if global_batch_size < world_size:
        raise ValueError(
            f"global batch size {global_batch_size} is smaller than the world size {world_size}; every "
            "layer may run on all ranks, so each needs at least one sample: raise the batch size or use "
            "fewer devices"
        )


def check_profile(graph: LayerGraph, profile: Profile) -> None:
    """Raise ValueError if the profile was made for another graph or lacks a layer."""
    if profile.graph_fingerprint != graph.fingerprint:
        raise ValueError(
            f"the profile was made for graph {profile.graph_fingerprint}, but this graph is "
            f"{graph.fingerprint}; profile this model again"
        )
    missing = [layer.name for layer in graph.layers if layer.name not in profile.layers]
    if missing:
        raise ValueError(f"the profile has no times for layers {missing[:5]}; profile this model again")


def per_device_batch(global_batch_size: int, width: int) -> int:
    """Samples on the busiest device of a layer of this width (rank 0 takes the remainder)."""
    return math.ceil(global_batch_size / width)


def compute_time(profile: Profile, layer: Layer, width: int, global_batch_size: int) -> float:
    """Profiled fwd+bwd seconds at ``ceil(B / width)``; raises outside the profiled batch sizes."""
    return profile.layer(layer.name).time(per_device_batch(global_batch_size, width))


def sync_time(comm: CommProfile, layer: Layer, width: int) -> float:
    """Seconds to all-reduce the layer's gradients among its ``width`` devices (0 at width 1)."""
    return comm.allreduce_time(width, layer.param_bytes)


def synced_bytes(graph: LayerGraph, widths: Mapping[str, int]) -> dict[str, int]:
    """Gradient bytes each layer's sync all-reduces under `widths`: its own parameters, a shared one
    moved from its first user to its widest (the first of them), where the runtime reduces it."""
    synced = {layer.name: layer.param_bytes for layer in graph.layers}
    for tied in graph.tied:
        widest = max(tied.users, key=lambda name: (widths[name], -graph.position(name)))
        synced[tied.users[0]] -= tied.param_bytes
        synced[widest] += tied.param_bytes
    return synced


def transfer_time(
    comm: CommProfile,
    sample_bytes: int,
    src_width: int,
    dst_width: int,
    *,
    world_size: int,
    global_batch_size: int,
) -> float:
    """Seconds to redistribute one value between two widths, forward and backward (0 if equal)."""
    if src_width == dst_width:
        return 0.0
    samples = busiest_samples(np.array([src_width, dst_width]), world_size, global_batch_size)[0, 1]
    return DIRECTIONS * comm.redistribute_time(int(samples) * sample_bytes)


def busiest_samples(widths: np.ndarray, world_size: int, global_batch_size: int) -> np.ndarray:
    """``layout.busiest_rank_samples`` between the ``layout.balanced`` layouts of every pair of widths.

    Vectorized (the reference is quadratic in the world size): a rank sends what it holds minus what it
    keeps (the overlap of its old and new sample ranges) and receives what it will hold minus the same.
    """
    ranks = np.arange(world_size)
    base, extra = np.divmod(global_batch_size, widths)
    counts = np.where(ranks < widths[:, None], base[:, None] + (ranks < extra[:, None]), 0)
    ends = np.cumsum(counts, axis=1)
    starts = ends - counts
    busiest = np.empty((len(widths), len(widths)), dtype=np.int64)
    for i in range(len(widths)):
        kept = np.clip(np.minimum(ends[i], ends) - np.maximum(starts[i], starts), 0, None)
        busiest[i] = np.maximum(counts[i] - kept, counts - kept).max(axis=1)
    return busiest


def edges(graph: LayerGraph) -> list[tuple[str, str]]:
    """Every (producer, consumer) value edge, once each, in execution order of the consumer."""
    return [(name, layer.name) for layer in graph.layers for name in dict.fromkeys(layer.inputs)]


def output_layers(graph: LayerGraph) -> list[str]:
    """Layers whose value is a graph output (each once): they return it to width N."""
    return [name for name in dict.fromkeys(graph.outputs) if graph.position(name) >= 0]


def evaluate(
    graph: LayerGraph,
    profile: Profile,
    widths: Mapping[str, int],
    *,
    world_size: int,
    global_batch_size: int,
) -> StepCost:
    """Predicted per-layer costs of an assignment ``{layer name: width}`` covering every layer."""
    check_sizes(world_size, global_batch_size)

    def width_of(name: str) -> int:
        return widths[name] if graph.position(name) >= 0 else world_size

    def move(value: str, src: int, dst: int) -> float:
        return transfer_time(
            profile.comm,
            graph.value_sample_bytes(value),
            src,
            dst,
            world_size=world_size,
            global_batch_size=global_batch_size,
        )

    synced = synced_bytes(graph, widths)
    transfer = {layer.name: 0.0 for layer in graph.layers}
    for producer, consumer in edges(graph):
        transfer[consumer] += move(producer, width_of(producer), widths[consumer])
    for producer in output_layers(graph):
        transfer[producer] += move(producer, widths[producer], world_size)
    return StepCost(
        {
            layer.name: LayerCost(
                compute_time(profile, layer, widths[layer.name], global_batch_size),
                profile.comm.allreduce_time(widths[layer.name], synced[layer.name]),
                transfer[layer.name],
            )
            for layer in graph.layers
        }
    )


def ddp_widths(graph: LayerGraph, world_size: int) -> dict[str, int]:
    """The data-parallel assignment: every layer on every device."""
    return {layer.name: world_size for layer in graph.layers}


def ddp_baseline(graph: LayerGraph, profile: Profile, *, world_size: int, global_batch_size: int) -> StepCost:
    """Plain data parallelism under the same cost model."""
    return evaluate(
        graph,
        profile,
        ddp_widths(graph, world_size),
        world_size=world_size,
        global_batch_size=global_batch_size,
    )


def layer_memory(profile: Profile, layer: Layer, width: int, global_batch_size: int) -> float:
    """Bytes on each of the layer's devices: profiled peak at its batch (0 if unmeasured), params, grads."""
    peak = profile.layer(layer.name).memory(per_device_batch(global_batch_size, width))
    return (peak or 0.0) + 2 * layer.param_bytes


def has_memory(profile: Profile, graph: LayerGraph) -> bool:
    """Whether any layer of the graph has profiled memory."""
    return any(profile.layer(layer.name).peak_bytes is not None for layer in graph.layers)


def memory_per_rank(
    graph: LayerGraph,
    profile: Profile,
    widths: Mapping[str, int],
    *,
    world_size: int,
    global_batch_size: int,
) -> list[float]:
    """Estimated bytes per rank: the layers it runs (rank r runs those wider than r); rank 0 is the max."""
    per_layer = [
        (widths[layer.name], layer_memory(profile, layer, widths[layer.name], global_batch_size))
        for layer in graph.layers
    ]
    return [sum(m for w, m in per_layer if w > rank) for rank in range(world_size)]
