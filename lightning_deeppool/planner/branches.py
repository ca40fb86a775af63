"""Branch regions: runs of layers that split into independent branches, which may run side by side on
disjoint ranks (the parallel branches of an Inception block, the towers of a two-tower model, the heads
of a multi-task model).

A region is a span of consecutive layers (execution order) cut into two or more branches, each a run of
consecutive layers, such that every layer of a branch reads only values from before the region (the
fork: layers' outputs or graph inputs) or of its own branch. A branch's values are then read only in
the branch, after the region or as graph outputs. The region ends before the first layer that reads a
value of a branch other than the last (the join, or any later reader), before a layer that reduces
over each rank's samples (`Layer.per_rank`, which runs at full width), or at the graph's end.

Recognized (`find_regions`): for each layer that reads no value of the layer just before it, the region
starting right after the latest layer it reads (at the graph's start when it reads only graph inputs).
Scanning from there, a layer reading no value of the region starts a new branch; a layer reading values
of several branches merges them (and the branches between) into one, unless that would leave fewer than
two, which ends the region. Regions do not nest: where two overlap, the one with more layers is kept
(the two towers, say, rather than an Inception block inside one of them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_deeppool.ir.graph import LayerGraph


@dataclass(frozen=True)
class Region:
    """Independent branches, each a run of consecutive layer names, the region's layers in order."""

    branches: tuple[tuple[str, ...], ...]

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(name for branch in self.branches for name in branch)


def find_regions(graph: LayerGraph) -> list[Region]:
    """The regions of `graph` (module docstring), in execution order, none overlapping another."""
    reads = [[graph.position(name) for name in layer.inputs] for layer in graph.layers]
    starts = sorted(
        {max(read, default=-1) + 1 for p, read in enumerate(reads) if max(read, default=-1) < p - 1}
    )
    found = [spans for spans in (_grow(graph, reads, start) for start in starts) if spans is not None]
    kept: list[list[tuple[int, int]]] = []
    for spans in sorted(found, key=lambda spans: spans[-1][1] - spans[0][0], reverse=True):
        if all(spans[-1][1] <= other[0][0] or other[-1][1] <= spans[0][0] for other in kept):
            kept.append(spans)
    names = [layer.name for layer in graph.layers]
    return [
        Region(tuple(tuple(names[a:b]) for a, b in spans)) for spans in sorted(kept, key=lambda s: s[0][0])
    ]


def _grow(graph: LayerGraph, reads: Sequence[Sequence[int]], start: int) -> list[tuple[int, int]] | None:
    """The branches, as ``[first, end)`` positions, of the region starting at `start`; None if fewer
    than two."""
    branches: list[list[int]] = []
    for position in range(start, len(graph.layers)):
        if graph.layers[position].per_rank:
            break
        inside = [read for read in reads[position] if read >= start]
        if not inside:
            branches.append([position, position + 1])
        else:
            lowest = min(_branch_of(branches, read) for read in inside)
            if lowest == 0 and len(branches) > 1:
                break  # the join: the branches before it are the region
            branches[lowest:] = [[branches[lowest][0], position + 1]]
    return [(a, b) for a, b in branches] if len(branches) > 1 else None


def _branch_of(branches: Sequence[Sequence[int]], position: int) -> int:
    """Index of the branch holding `position`."""
    return next(i for i, (a, b) in enumerate(branches) if a <= position < b)
