"""How sure a plan is: the best plan of another shape beside it, and the profiles' spread over what
the two run differently (`Alternative`). Pure functions, no torch.

The spread of a difference between two plans combines, over the layers they place differently, each
layer's spread (`LayerProfile.spread`, scaled as its times are) at both placements as independent
errors add: the root of the sum of their squares (each layer and batch size is timed on its own).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from lightning_deeppool.ir.graph import LayerGraph
from lightning_deeppool.ir.placement import Placement, equal_width_runs
from lightning_deeppool.ir.profile import Profile
from lightning_deeppool.planner import cost


@dataclass(frozen=True)
class Alternative:
    """The best plan of another shape than the chosen one: what it is (`shape`, as `describe`
    writes it), its predicted step seconds, and the layer profiles' spread over the layers the two
    place differently (None where the profile records no spread)."""

    shape: str
    step_time_s: float
    spread_s: float | None


def layer_spread(
    graph: LayerGraph, profile: Profile, name: str, placement: Placement, global_batch_size: int
) -> float | None:
    """The spread of a layer's profiled time at `placement` (interpolated between profiled batch
    sizes, at the samples' worth one device computes); None where the profile records none."""
    layer = graph.layer(name)
    measured = profile.layer(name)
    if measured.spread is None:
        return None
    samples = cost.effective_samples(layer, placement, global_batch_size, cost.halo_share(graph, layer))
    return float(np.interp(samples, measured.batch_sizes, measured.spread))


def spread_between(
    graph: LayerGraph,
    profile: Profile,
    a: Mapping[str, Placement],
    b: Mapping[str, Placement],
    global_batch_size: int,
) -> float | None:
    """The layer spreads at both placements of every layer `a` and `b` place differently, combined as
    independent errors (root of the sum of squares); None where some such layer has no recorded
    spread."""
    squares = 0.0
    for layer in graph.layers:
        if a[layer.name] == b[layer.name]:
            continue
        for placement in (a[layer.name], b[layer.name]):
            spread = layer_spread(graph, profile, layer.name, placement, global_batch_size)
            if spread is None:
                return None
            squares += spread**2
    return math.sqrt(squares)


def describe(graph: LayerGraph, placements: Mapping[str, Placement], widest: Placement) -> str:
    """A plan's shape in words: ``every layer at full width``, else its runs of layers off full width,
    ``wide_0..head at width 1, conv at width 4 split in 2``."""
    names = [layer.name for layer in graph.layers]
    runs = [run for run in equal_width_runs(names, placements) if placements[run[0]] != widest]
    if not runs:
        return "every layer at full width"
    return ", ".join(f"{_span(run)} at {_placement(placements[run[0]])}" for run in runs)


def _span(run: list[str]) -> str:
    return run[0] if len(run) == 1 else f"{run[0]}..{run[-1]}"


def _placement(placement: Placement) -> str:
    text = f"width {placement.width}"
    if placement.spatial > 1:
        text += f" split in {placement.spatial}"
    if placement.first:
        text += f" from rank {placement.first}"
    return text
