"""Which layers can run on samples split by height, read off their operations (issue 11).

A layer splits when every value it reads is an image batch ``(N, C, H, W)`` of one height and every
operation on a split value is spatially local: a 2-d convolution or max pooling (which read a halo of
neighbouring rows), BatchNorm (whose statistics the parts reduce together), a pointwise operation or a
concatenation along channels; and every value it produces is split. `split_shape` gives the planner's
`Layer.height` and `Layer.halo_bytes`; the runtime (`strategy.spatial_layer`) follows the same rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

from lightning_deeppool.capture.graph import LayerCode
from lightning_deeppool.capture.trace import Leaf, Trace
from lightning_deeppool.planner.spatial import Window

aten = torch.ops.aten
SPLIT_DIM = 2  # the height of an (N, C, H, W) tensor

# Elementwise on their tensor arguments: a part's rows give the part's rows of the result.
POINTWISE = {
    aten.relu.default,
    aten.relu_.default,
    aten.add.Tensor,
    aten.add_.Tensor,
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
CONVOLUTION = aten.conv2d.default
MAX_POOLING = aten.max_pool2d.default
BATCH_NORM = aten.batch_norm.default
CONCATENATION = aten.cat.default
SPATIALLY_LOCAL = {*POINTWISE, CONVOLUTION, MAX_POOLING, BATCH_NORM, CONCATENATION}


def arguments(node: fx.Node, env: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A node's arguments by name, looked up in `env` (by node name) or left as nodes."""
    args = node.args if env is None else fx.node.map_arg(node.args, lambda n: env[n.name])
    kwargs = node.kwargs if env is None else fx.node.map_arg(node.kwargs, lambda n: env[n.name])
    normalized = normalize_function(node.target, args, kwargs, normalize_to_only_use_kwargs=True)  # type: ignore[arg-type]
    assert normalized is not None, node.target
    return dict(normalized.kwargs)


def window(target: Any, a: Mapping[str, Any], kernel: int | None = None) -> Window:
    """The window of a convolution (`kernel`: its weight's height) or a max pooling along the height."""
    if target == CONVOLUTION:
        assert kernel is not None
        return Window(kernel, pair(a["stride"])[0], pair(a["padding"])[0], pair(a["dilation"])[0])
    size = pair(a["kernel_size"])
    stride = pair(a["stride"]) if len(a["stride"]) else size
    return Window(size[0], stride[0], pair(a["padding"])[0], pair(a["dilation"])[0])


def pair(value: Any, dims: int = 2) -> list[int]:
    """An ``int[dims]`` argument as `dims` ints (ATen accepts one for all)."""
    return [value] * dims if isinstance(value, int) else list(value) * (dims // len(value))


def refusal(node: fx.Node, a: Mapping[str, Any]) -> str | None:
    """Why an operation reading a split value cannot run on the parts, or None when it can."""
    if node.target not in SPATIALLY_LOCAL:
        return f"{node.target} is not spatially local"
    if node.target == MAX_POOLING and a["ceil_mode"]:
        return f"{node.target} with ceil_mode=True is not supported on split samples"
    if node.target == CONCATENATION and a["dim"] in (SPLIT_DIM, SPLIT_DIM - 4):
        return f"{node.target} along the height concatenates across the split"
    return None


def split_shape(trace: Trace, code: LayerCode) -> tuple[int, int]:
    """``(height, halo_bytes)`` of a layer (`planner.graph.Layer`): the fewest rows of any value it
    splits (so `height` parts each hold a row of every one), ``(0, 0)`` when it cannot split."""
    reads = [name for _, names in code.reads for name in names]
    heights = {name: _image(trace, name) for name in reads}
    if len(set(heights.values())) != 1 or 0 in heights.values():
        return 0, 0
    halo = 0
    for node in code.nodes:
        if node.op != "call_function" or not any(n.name in heights for n in node.all_input_nodes):
            continue
        if node.target not in SPATIALLY_LOCAL:  # recorded graphs hold torch functions: not split
            return 0, 0
        a = arguments(node)
        heights[node.name] = _image(trace, node.name)
        if refusal(node, a) is not None or not heights[node.name]:
            return 0, 0
        if node.target in (CONVOLUTION, MAX_POOLING):
            source = _leaf(trace, a["input"].name)
            weight = _leaf(trace, a["weight"].name) if node.target == CONVOLUTION else None
            rows = window(node.target, a, weight.shape[2] if weight is not None else None)
            assert source is not None
            halo += (
                max(0, rows.extent - rows.stride) * source.shape[1] * source.shape[3] * source.dtype.itemsize
            )
    if not all(name in heights for name in code.outputs):
        return 0, 0
    return min(heights.values()), halo


def _leaf(trace: Trace, name: str) -> Leaf | None:
    leaves = trace.leaves.get(name, ())
    return leaves[0] if len(leaves) == 1 else None


def _image(trace: Trace, name: str) -> int:
    """The height of a node's value when it is one image batch ``(N, C, H, W)``, else 0."""
    leaf = _leaf(trace, name)
    if leaf is None or leaf.batch_dims != (0,) or leaf.rows != 1 or len(leaf.shape) != 4:
        return 0
    return leaf.shape[SPLIT_DIM]
