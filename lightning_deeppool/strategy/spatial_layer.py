"""Run a captured layer on one part of spatially split samples (the runtime of a `spatial` placement).

Convolutions and max pooling first gather their halo (`halo.gather_slab`), BatchNorm reduces its
statistics over the parts (`spatial_norm.split_batch_norm`), and pointwise operations, adds and
channel concatenations run on the part as they are (`capture.spatial` has the rules). Any other
operation on a split value is refused with the operation's name: the parts must be gathered before
such a layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_deeppool.capture import CapturedGraph
from lightning_deeppool.capture.graph import BATCH_SIZE, evaluate, unpack
from lightning_deeppool.capture.spatial import (
    BATCH_NORM,
    CONCATENATION,
    CONVOLUTION,
    MAX_POOLING,
    SPLIT_DIM,
    arguments,
    pair,
    refusal,
    window,
)
from lightning_deeppool.planner.spatial import Window, part_rows
from lightning_deeppool.strategy.halo import gather_slab
from lightning_deeppool.strategy.spatial_norm import split_batch_norm


@dataclass(frozen=True)
class SpatialPart:
    """This rank's part of samples split by height over the global `ranks` (in part order):
    statistics are reduced over `group` (those ranks), halos move over `messages` (the world)."""

    ranks: tuple[int, ...]
    index: int
    group: dist.ProcessGroup | None = None
    messages: dist.ProcessGroup | None = None

    def rows(self, size: int) -> tuple[int, int]:
        """The rows ``[start, stop)`` of a dimension of `size` rows this part holds."""
        return part_rows(size, len(self.ranks), self.index)

    def slab(self, value: torch.Tensor, size: int, window: Window, fill: float = 0.0) -> torch.Tensor:
        """The input slab `window` needs for this part's output rows (`halo.gather_slab`)."""
        return gather_slab(
            value,
            dim=SPLIT_DIM,
            size=size,
            window=window,
            ranks=self.ranks,
            index=self.index,
            fill=fill,
            group=self.messages,
        )


def run_layer_split(
    captured: CapturedGraph,
    name: str,
    values: Mapping[str, Any],
    batch_size: int,
    local: Mapping[str, Any],
    part: SpatialPart,
    sizes: Mapping[str, int],
) -> tuple[Any, dict[str, int]]:
    """Layer `name` on this part, like `CapturedGraph.run_layer`. `sizes` gives the whole size along
    `SPLIT_DIM` of every split value the layer reads (by node name); returns the layer's value and the
    whole sizes of its split outputs."""
    code = captured.code[name]
    env: dict[str, Any] = {BATCH_SIZE: batch_size, **local}
    for source, nodes in code.reads:
        unpack(captured, source, values[source], env, nodes)
    split = dict(sizes)
    for node in code.nodes:
        inputs = [split[n.name] for n in node.all_input_nodes if n.name in split]
        if not inputs:
            env[node.name] = evaluate(captured.module, node, env)
            continue
        a = arguments(node, env)
        why = refusal(node, a)
        if why is not None:
            raise ValueError(
                f"layer {name!r}: {why}, so it cannot run on samples split by height; only convolutions, "
                "max pooling, BatchNorm, pointwise operations, adds and channel concatenations can. Plan "
                "this layer with spatial 1"
            )
        if len(set(inputs)) > 1:
            raise ValueError(f"layer {name!r}: {node.target} combines split values of sizes {inputs}")
        run = _RULES.get(node.target)  # type: ignore[arg-type]
        if run is None:
            env[node.name], split[node.name] = evaluate(captured.module, node, env), inputs[0]
        else:
            env[node.name], split[node.name] = run(a, part, inputs[0])
    return tuple(env[output] for output in code.outputs), {o: split[o] for o in code.outputs if o in split}


def _convolution(a: Mapping[str, Any], part: SpatialPart, size: int) -> tuple[Any, int]:
    rows = window(CONVOLUTION, a, a["weight"].shape[2])
    slab = part.slab(a["input"], size, rows)
    padding = [0, pair(a["padding"])[1]]
    out = CONVOLUTION(slab, a["weight"], a["bias"], a["stride"], padding, a["dilation"], a["groups"])
    return out, rows.output_size(size)


def _max_pooling(a: Mapping[str, Any], part: SpatialPart, size: int) -> tuple[Any, int]:
    rows = window(MAX_POOLING, a)
    slab = part.slab(a["input"], size, rows, fill=float("-inf"))
    kernel = pair(a["kernel_size"])
    stride = pair(a["stride"]) if len(a["stride"]) else kernel
    out = MAX_POOLING(slab, kernel, stride, [0, pair(a["padding"])[1]], a["dilation"], False)
    return out, rows.output_size(size)


def _batch_norm(a: Mapping[str, Any], part: SpatialPart, size: int) -> tuple[Any, int]:
    out = split_batch_norm(
        a["input"],
        a["running_mean"],
        a["running_var"],
        a["weight"],
        a["bias"],
        training=a["training"],
        momentum=a["momentum"],
        eps=a["eps"],
        dim=SPLIT_DIM,
        size=size,
        group=part.group,
    )
    return out, size


def _concatenation(a: Mapping[str, Any], part: SpatialPart, size: int) -> tuple[Any, int]:
    return torch.cat(a["tensors"], a["dim"]), size


_RULES: dict[Any, Callable[[Mapping[str, Any], SpatialPart, int], tuple[Any, int]]] = {
    CONVOLUTION: _convolution,
    MAX_POOLING: _max_pooling,
    BATCH_NORM: _batch_norm,
    CONCATENATION: _concatenation,
}
