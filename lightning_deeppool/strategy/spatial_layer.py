"""Run a captured layer on one part of spatially split samples (issue 11's runtime, not yet planned).

Convolutions and max pooling first gather their halo (`halo.gather_slab`), BatchNorm reduces its
statistics over the parts (`spatial_norm.split_batch_norm`), and pointwise operations, adds and
channel concatenations run on the part as they are. Any other operation on a split value is refused
with the operation's name: the parts must be gathered before such a layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.fx.operator_schemas import normalize_function

from lightning_deeppool.capture import CapturedGraph
from lightning_deeppool.capture.graph import BATCH_SIZE, evaluate, unpack
from lightning_deeppool.planner.spatial import Window, part_rows
from lightning_deeppool.strategy.halo import gather_slab
from lightning_deeppool.strategy.spatial_norm import split_batch_norm

aten = torch.ops.aten
# Elementwise on their tensor arguments: a part's rows give the part's rows of the result.
POINTWISE = {
    aten.relu.default,
    aten.relu_.default,
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.sigmoid.default,
    aten.tanh.default,
    aten.gelu.default,
    aten.silu.default,
    aten.hardtanh.default,
    aten.leaky_relu.default,
    aten.clone.default,
    aten.dropout.default,
}


@dataclass(frozen=True)
class SpatialPart:
    """This rank's part of samples split along `dim` over the global `ranks` (in part order)."""

    ranks: tuple[int, ...]
    index: int
    dim: int = 2
    group: dist.ProcessGroup | None = None

    def rows(self, size: int) -> tuple[int, int]:
        """The rows ``[start, stop)`` of a dimension of `size` rows this part holds."""
        return part_rows(size, len(self.ranks), self.index)

    def slab(self, value: torch.Tensor, size: int, window: Window, fill: float = 0.0) -> torch.Tensor:
        """The input slab `window` needs for this part's output rows (`halo.gather_slab`)."""
        return gather_slab(
            value,
            dim=self.dim,
            size=size,
            window=window,
            ranks=self.ranks,
            index=self.index,
            fill=fill,
            group=self.group,
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
    `part.dim` of every split value the layer reads (by node name); returns the layer's value and the
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
        run = _RULES.get(node.target)  # type: ignore[arg-type]
        if run is None and node.target not in POINTWISE:
            raise ValueError(
                f"layer {name!r}: {node.target} cannot run on samples split along dimension {part.dim}; "
                "only convolutions, max pooling, BatchNorm, pointwise operations, adds and channel "
                "concatenations can. Plan this layer with spatial 1"
            )
        if len(set(inputs)) > 1:
            raise ValueError(f"layer {name!r}: {node.target} combines split values of sizes {inputs}")
        if run is None:
            env[node.name], split[node.name] = evaluate(captured.module, node, env), inputs[0]
        else:
            env[node.name], split[node.name] = run(node, env, part, inputs[0])
    return tuple(env[output] for output in code.outputs), {o: split[o] for o in code.outputs if o in split}


def _arguments(node: fx.Node, env: Mapping[str, Any]) -> dict[str, Any]:
    args = fx.node.map_arg(node.args, lambda n: env[n.name])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n.name])
    normalized = normalize_function(node.target, args, kwargs, normalize_to_only_use_kwargs=True)  # type: ignore[arg-type]
    assert normalized is not None, node.target
    return dict(normalized.kwargs)


def _convolution(node: fx.Node, env: Mapping[str, Any], part: SpatialPart, size: int) -> tuple[Any, int]:
    a = _arguments(node, env)
    stride, padding, dilation = list(a["stride"]), list(a["padding"]), list(a["dilation"])
    window = Window(a["weight"].shape[2], stride[0], padding[0], dilation[0])
    slab = part.slab(a["input"], size, window)
    out = torch.ops.aten.conv2d(slab, a["weight"], a["bias"], stride, [0, padding[1]], dilation, a["groups"])
    return out, window.output_size(size)


def _max_pooling(node: fx.Node, env: Mapping[str, Any], part: SpatialPart, size: int) -> tuple[Any, int]:
    a = _arguments(node, env)
    kernel, padding, dilation = _pair(a["kernel_size"]), _pair(a["padding"]), _pair(a["dilation"])
    stride = _pair(a["stride"]) if len(a["stride"]) else kernel
    if a["ceil_mode"]:
        raise ValueError(f"{node.target} with ceil_mode=True cannot run on split samples yet")
    window = Window(kernel[0], stride[0], padding[0], dilation[0])
    slab = part.slab(a["input"], size, window, fill=float("-inf"))
    out = torch.ops.aten.max_pool2d(slab, kernel, stride, [0, padding[1]], dilation, False)
    return out, window.output_size(size)


def _pair(value: Any) -> list[int]:
    """An ``int[2]`` argument as two ints (ATen accepts one for both)."""
    return [value, value] if isinstance(value, int) else list(value) * (2 // len(value))


def _batch_norm(node: fx.Node, env: Mapping[str, Any], part: SpatialPart, size: int) -> tuple[Any, int]:
    a = _arguments(node, env)
    out = split_batch_norm(
        a["input"],
        a["running_mean"],
        a["running_var"],
        a["weight"],
        a["bias"],
        training=a["training"],
        momentum=a["momentum"],
        eps=a["eps"],
        dim=part.dim,
        size=size,
        group=part.group,
    )
    return out, size


def _concatenation(node: fx.Node, env: Mapping[str, Any], part: SpatialPart, size: int) -> tuple[Any, int]:
    a = _arguments(node, env)
    if a["dim"] in (part.dim, part.dim - a["tensors"][0].dim()):
        raise ValueError(f"{node.target} along the split dimension {part.dim} cannot run on split samples")
    return torch.cat(a["tensors"], a["dim"]), size


_RULES: dict[Any, Callable[[fx.Node, Mapping[str, Any], SpatialPart, int], tuple[Any, int]]] = {
    aten.conv2d.default: _convolution,
    aten.max_pool2d.default: _max_pooling,
    aten.batch_norm.default: _batch_norm,
    aten.cat.default: _concatenation,
}
