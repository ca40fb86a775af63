"""Synthetic graphs, profiles and a brute-force reference for the planner tests."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import numpy as np

from lightning_deeppool.ir.graph import GraphInput, Layer, LayerGraph
from lightning_deeppool.ir.placement import Placement
from lightning_deeppool.ir.profile import AlphaBeta, CommProfile, LayerProfile, Profile
from lightning_deeppool.planner import cost

# A slow link, so that transfers and syncs compete with compute in millisecond-sized examples.
SLOW_LINK = CommProfile(link=AlphaBeta(latency_s=20e-6, seconds_per_byte=1e-9), overlap=False)


def layer(
    name: str, inputs: Sequence[str], *, sample_bytes: int = 4096, params: int = 0, module: bool = True
) -> Layer:
    """A module layer (module = name with '_' read as '.') or, with module=False, a function layer."""
    return Layer(
        name=name,
        op="call_module" if module else "call_function",
        target=name.replace("_", ".") if module else "add",
        inputs=tuple(inputs),
        sample_bytes=sample_bytes,
        params=params,
        param_bytes=4 * params,
    )


def conv(
    name: str, inputs: Sequence[str], *, rows: int = 512, channels_in: int = 16, channels: int = 16
) -> Layer:
    """A 3x3 convolution on ``rows x rows`` float32 images: splittable by height, a two-row halo."""
    return Layer(
        name=name,
        op="call_module",
        target=name.replace("_", "."),
        inputs=tuple(inputs),
        sample_bytes=4 * channels * rows * rows,
        params=9 * channels_in * channels,
        param_bytes=36 * channels_in * channels,
        height=rows,
        halo_bytes=2 * 4 * channels_in * rows,
    )


def conv_net(n: int = 3, *, rows: int = 512) -> LayerGraph:
    """``x`` (3-channel ``rows x rows`` images) -> n convolutions -> a linear ``head`` (not splittable)."""
    convs = [
        conv(f"conv{i}", ["x" if i == 0 else f"conv{i - 1}"], rows=rows, channels_in=3 if i == 0 else 16)
        for i in range(n)
    ]
    head = layer("head", [convs[-1].name], sample_bytes=40, params=1000)
    return graph_of([*convs, head], input_bytes=4 * 3 * rows * rows)


def graph_of(
    layers: Sequence[Layer], *, outputs: Sequence[str] | None = None, input_bytes: int = 4096
) -> LayerGraph:
    """A graph reading one input ``x``, returning the last layer unless told otherwise."""
    return LayerGraph(
        inputs=(GraphInput("x", input_bytes),),
        layers=tuple(layers),
        outputs=tuple(outputs) if outputs is not None else (layers[-1].name,),
    )


def chain(n: int, **kwargs: int) -> LayerGraph:
    """``x -> l0 -> l1 -> ... -> l{n-1}``."""
    return graph_of([layer(f"l{i}", ["x" if i == 0 else f"l{i - 1}"], **kwargs) for i in range(n)])


def linear_profile(
    graph: LayerGraph,
    times: dict[str, tuple[float, float]],
    *,
    max_batch: int,
    comm: CommProfile = SLOW_LINK,
    activation_bytes_per_sample: dict[str, int] | None = None,
) -> Profile:
    """Times ``fixed + per_sample * b`` (and memory ``bytes * b``) measured at every batch 1..max_batch."""
    batches = tuple(range(1, max_batch + 1))
    layers = {}
    for name, (fixed, per_sample) in times.items():
        kept = None
        if activation_bytes_per_sample is not None:
            kept = tuple(activation_bytes_per_sample[name] * b for b in batches)
        layers[name] = LayerProfile(name, batches, tuple(fixed + per_sample * b for b in batches), kept)
    return Profile(graph.fingerprint, "synthetic", "float32", layers, comm)


def random_times(graph: LayerGraph, rng: random.Random) -> dict[str, tuple[float, float]]:
    """Layers from launch-bound (barely scale) to compute-bound (scale well), 10 us .. 2 ms."""
    return {
        item.name: (rng.uniform(10e-6, 1e-3), rng.uniform(0, 200e-6) * rng.choice([0.01, 1, 10]))
        for item in graph.layers
    }


def random_chain(rng: random.Random, n: int) -> LayerGraph:
    return graph_of(
        [
            layer(
                f"l{i}",
                ["x" if i == 0 else f"l{i - 1}"],
                sample_bytes=rng.choice([256, 4096, 65536]),
                params=rng.choice([0, 1000, 100_000, 1_000_000]),
            )
            for i in range(n)
        ],
        input_bytes=rng.choice([256, 65536]),
    )


def random_dag(rng: random.Random, n: int) -> LayerGraph:
    """Chains with residual adds (two inputs), concat-like joins (three) and re-reads of the input."""
    layers: list[Layer] = []
    for i in range(n):
        earlier = ["x", *(item.name for item in layers)]
        previous = earlier[-1]
        kind = rng.random()
        if kind < 0.3 and len(earlier) > 2:
            inputs = [previous, rng.choice(earlier[:-1])]
        elif kind < 0.45 and len(earlier) > 3:
            inputs = [previous, *rng.sample(earlier[:-1], 2)]
        else:
            inputs = [previous]
        layers.append(
            layer(
                f"l{i}",
                inputs,
                sample_bytes=rng.choice([256, 4096, 65536]),
                params=rng.choice([0, 1000, 100_000, 1_000_000]),
                module=len(inputs) == 1,
            )
        )
    outputs = [layers[-1].name] + (
        [layers[rng.randrange(n - 1)].name] if n > 1 and rng.random() < 0.3 else []
    )
    return graph_of(layers, outputs=outputs)


def brute_force(
    graph: LayerGraph,
    profile: Profile,
    *,
    world_size: int,
    global_batch_size: int,
    allowed: dict[str, list[int]] | None = None,
) -> tuple[float, dict[str, int]]:
    """Least predicted step time over every assignment of widths 1..N (or the allowed ones), by enumeration.

    Per-layer and per-edge terms come from the scalar cost functions (the reference layout code).
    """
    size = world_size
    sizes = dict(world_size=world_size, global_batch_size=global_batch_size)
    options = [allowed[item.name] if allowed else list(range(1, size + 1)) for item in graph.layers]
    combos = np.array(list(itertools.product(*options)), dtype=np.int64)
    total = np.zeros(len(combos))
    for k, item in enumerate(graph.layers):
        own = np.zeros(size + 1)
        for w in range(1, size + 1):
            own[w] = cost.compute_time(profile, item, w, global_batch_size) + cost.sync_time(
                profile.comm, item, w
            )
            if item.name in cost.output_layers(graph):
                own[w] += cost.transfer_time(profile.comm, item.sample_bytes, w, size, **sizes)
        total += own[combos[:, k]]
    for producer, consumer in cost.edges(graph):
        nbytes, directions = graph.value_sample_bytes(producer), cost.move_directions(graph, producer)
        table = np.array(
            [
                [
                    cost.transfer_time(profile.comm, nbytes, a, b, **sizes, directions=directions)
                    if a and b
                    else 0.0
                    for b in range(size + 1)
                ]
                for a in range(size + 1)
            ]
        )
        src = (
            combos[:, graph.position(producer)]
            if graph.position(producer) >= 0
            else np.full(len(combos), size)
        )
        total += table[src, combos[:, graph.position(consumer)]]
    best = int(np.argmin(total))
    return float(total[best]), {item.name: int(combos[best, k]) for k, item in enumerate(graph.layers)}


def brute_force_placements(
    graph: LayerGraph,
    profile: Profile,
    *,
    world_size: int,
    global_batch_size: int,
    options: dict[str, list[Placement]],
) -> float:
    """Least predicted step time (with the once-a-step costs) over every assignment of the given
    placements, each costed by `cost.evaluate` as the search does."""
    sizes = dict(world_size=world_size, global_batch_size=global_batch_size)
    names = [item.name for item in graph.layers]
    return min(
        cost.evaluate(graph, profile, dict(zip(names, combo)), **sizes).total_s + profile.per_step_s
        for combo in itertools.product(*(options[name] for name in names))
    )
