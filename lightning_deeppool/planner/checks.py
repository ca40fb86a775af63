"""Validation: whether a world and batch, a profile, and a layer's placement can be planned. Each check
raises ValueError naming the layer or the numbers at fault; none costs anything."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from lightning_deeppool.ir.graph import Layer, LayerGraph
from lightning_deeppool.ir.placement import Placement
from lightning_deeppool.ir.profile import Profile


def check_sizes(world_size: int, global_batch_size: int, graph: LayerGraph | None = None) -> None:
    """Raise ValueError unless the world and the global batch can be planned (for `graph`).

    A batch smaller than the world is plannable only when some layer of `graph` can be split by
    height (the ranks past the batch have work only then) and no layer reduces over each rank's own
    samples; without a graph it is refused.
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if global_batch_size < 1:
        raise ValueError(f"global batch size must be >= 1, got {global_batch_size}")
    if global_batch_size >= world_size:
        return
    if graph is None or not any(layer.height for layer in graph.layers):
        raise ValueError(
            f"global batch size {global_batch_size} is smaller than the world size {world_size}; no layer "
            "can be split by height (only convolutions, pooling, BatchNorm and pointwise layers can), so "
            "the ranks past the batch would have no sample: raise the batch size or use fewer devices"
        )
    per_rank = [layer.name for layer in graph.layers if layer.per_rank]
    if per_rank:
        raise ValueError(
            f"layer {per_rank[0]!r} reduces over each rank's own samples (a loss inside forward), so every "
            f"rank needs a sample, but the global batch size {global_batch_size} is smaller than the world "
            f"size {world_size}: raise the batch size, use fewer devices, or compute the loss outside forward"
        )


def as_placement(value: object, what: str) -> Placement:
    """`value` as a `Placement`: a width (int, not split, from rank 0), a Placement, or a mapping
    ``{"width": w, "spatial": s}`` (spatial 1 when absent) or ``{"ranks": [2, 3], "spatial": s}``
    (consecutive ranks: width 2 from rank 2). ValueError starting with `what` otherwise."""
    if isinstance(value, Placement):
        return value
    width: object
    spatial: object = 1
    first = 0
    if isinstance(value, Mapping):
        unknown = sorted(map(str, set(value) - {"width", "spatial", "ranks"}))
        if unknown or not {"width", "ranks"} & set(value):
            problem = f"unknown keys {unknown}" if unknown else "no 'width' or 'ranks'"
            raise ValueError(
                f"{what}: {dict(value)!r} has {problem}; give a width or a mapping like "
                "{'width': 4, 'spatial': 2} (4 devices: 2 sample groups, each sample in 2 parts) or "
                "{'ranks': [2, 3]} (ranks 2 and 3)"
            )
        spatial = value.get("spatial", 1)
        width = value.get("width")
        if "ranks" in value:
            first, count = _rank_range(value["ranks"], what)
            if width is not None and width != count:
                raise ValueError(
                    f"{what}: width {width!r} but {count} ranks {list(value['ranks'])}; give one"
                )
            width = count
    else:
        width = value
    whole, parts = _integer(width), _integer(spatial)
    if whole is None or parts is None:
        raise ValueError(
            f"{what}: {value!r} is not a width (an int), a Placement or a mapping like "
            "{'width': 4, 'spatial': 2} or {'ranks': [2, 3]}"
        )
    return Placement(whole, parts, first)


def _rank_range(ranks: object, what: str) -> tuple[int, int]:
    """The first rank and the count of a list of consecutive ranks, in increasing order."""
    given = list(ranks) if isinstance(ranks, (list, tuple, range)) else []
    numbers = [_integer(rank) for rank in given]
    if not numbers or None in numbers:
        raise ValueError(f"{what}: ranks {ranks!r} are not a non-empty list of ints, e.g. [2, 3]")
    first = numbers[0] or 0
    if first < 0 or numbers != list(range(first, first + len(numbers))):
        raise ValueError(
            f"{what}: ranks {given} are not consecutive ranks in increasing order (>= 0); a layer "
            f"runs on a range of ranks, e.g. [{max(first, 0)}, {max(first, 0) + 1}]"
        )
    return first, len(numbers)


def _integer(value: object) -> int | None:
    return int(value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else None


def check_placement(
    layer: Layer, placement: Placement, *, world_size: int, global_batch_size: int | None
) -> None:
    """Raise ValueError naming the layer unless it can run at `placement`: width in 1..N, a spatial split
    that divides the width, only on a layer with a height and into at most its rows, ranks that are all
    in the world, and at most one sample group per sample of the global batch (unchecked when the batch
    is None)."""
    width, spatial, first = placement
    if not 1 <= width <= world_size:
        raise ValueError(f"layer {layer.name!r} has width {width}, outside 1..{world_size}")
    if not 0 <= first <= world_size - width:
        raise ValueError(
            f"layer {layer.name!r}: ranks {first}..{first + width - 1} are not all in a world of "
            f"{world_size} ranks (0..{world_size - 1}); start at a rank from 0 to {world_size - width}"
        )
    if spatial < 1 or width % spatial:
        raise ValueError(
            f"layer {layer.name!r}: spatial {spatial} does not divide width {width}; split each sample in a "
            f"number of parts that divides the width (1: not split)"
        )
    if spatial > 1 and not layer.height:
        raise ValueError(
            f"layer {layer.name!r} cannot be split by height (spatial {spatial}): only convolutions, "
            "pooling, BatchNorm and pointwise layers can; give it spatial 1"
        )
    if spatial > layer.height > 0:
        raise ValueError(
            f"layer {layer.name!r}: spatial {spatial} is more parts than its {layer.height} rows; use at "
            f"most spatial {layer.height}"
        )
    if global_batch_size is not None and placement.groups > global_batch_size:
        instead = (
            ", or split each sample in more parts (a larger spatial)"
            if layer.height
            else ": it cannot be split by height"
        )
        groups, samples = _count(placement.groups, "sample group"), _count(global_batch_size, "sample")
        raise ValueError(
            f"layer {layer.name!r}: width {width} at spatial {spatial} makes {groups} but the global batch "
            f"has {samples}; use at most {_count(global_batch_size, 'group')} (width <= "
            f"{global_batch_size * spatial} at spatial {spatial}){instead}"
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


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
