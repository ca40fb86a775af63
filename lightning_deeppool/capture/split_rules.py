"""Which layers can run on samples split by height, read off their operations.

A layer splits when every value it reads is a batch of images ``(N, C, H, W)`` (or 1-d ``(N, C, L)``,
3-d ``(N, C, D, H, W)``: split along L or D) of one height and every operation on a split value is
spatially local: a convolution or a 2-/3-d max pooling (which read a halo of neighbouring rows),
BatchNorm (whose statistics the parts reduce together), a pointwise operation or a concatenation
along channels; and every value it produces is split. `split_shape` gives the planner's
`Layer.height` and `Layer.halo_bytes`; the runtime (`spatial.layer`) follows the same rules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

from lightning_deeppool.capture.graph import LayerCode
from lightning_deeppool.capture.trace import Leaf, Trace
from lightning_deeppool.ir.rows import SPLIT_DIM, Window

aten = torch.ops.aten

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
CONVOLUTIONS = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default}
MAX_POOLINGS = {aten.max_pool2d.default, aten.max_pool3d.default}
BATCH_NORM = aten.batch_norm.default
CONCATENATION = aten.cat.default
SPATIALLY_LOCAL = {*POINTWISE, *CONVOLUTIONS, *MAX_POOLINGS, BATCH_NORM, CONCATENATION}


def arguments(node: fx.Node, env: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A node's arguments by name, looked up in `env` (by node name) or left as nodes. The names are
    bound once per node (the runtime asks at every step)."""
    named = node.meta.get("deeppool_arguments")
    if named is None:
        target: Any = node.target
        normalized = normalize_function(target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        assert normalized is not None, node.target
        named = node.meta["deeppool_arguments"] = dict(normalized.kwargs)
    if env is None:
        return dict(named)
    return {name: fx.node.map_arg(value, lambda n: env[n.name]) for name, value in named.items()}


def window(target: Any, a: Mapping[str, Any], kernel: int | None = None) -> Window:
    """The window along the split dimension of a convolution (`kernel`: its weight's size there) or
    of a max pooling."""
    if target in CONVOLUTIONS:
        assert kernel is not None
        return Window(kernel, pair(a["stride"])[0], pair(a["padding"])[0], pair(a["dilation"])[0])
    size = pair(a["kernel_size"])
    stride = pair(a["stride"]) if len(a["stride"]) else size
    return Window(size[0], stride[0], pair(a["padding"])[0], pair(a["dilation"])[0], a["ceil_mode"])


def pair(value: Any, dims: int = 2) -> list[int]:
    """An ``int[dims]`` argument as a list (ATen accepts one int for all)."""
    values = [value] if isinstance(value, int) else list(value)
    return values * dims if len(values) == 1 else values


def refusal(node: fx.Node, a: Mapping[str, Any]) -> str | None:
    """Why an operation reading a split value cannot run on the parts, or None when it can."""
    if node.target not in SPATIALLY_LOCAL:
        return f"{node.target} is not spatially local"
    if node.target == CONCATENATION and a["dim"] in (SPLIT_DIM, SPLIT_DIM - _dims(a["tensors"][0])):
        return f"{node.target} along the height concatenates across the split"
    return None


def split_shape(trace: Trace, code: LayerCode) -> tuple[int, int]:
    """``(height, halo_bytes)`` of a layer (`ir.graph.Layer`): the fewest rows of any value it
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
        if node.target in CONVOLUTIONS or node.target in MAX_POOLINGS:
            source = _leaf(trace, a["input"].name)
            weight = _leaf(trace, a["weight"].name) if node.target in CONVOLUTIONS else None
            rows = window(node.target, a, weight.shape[2] if weight is not None else None)
            assert source is not None
            halo += (
                max(0, rows.extent - rows.stride)
                * math.prod(source.shape[1:])
                // source.shape[SPLIT_DIM]
                * source.dtype.itemsize
            )
    if not all(name in heights for name in code.outputs):
        return 0, 0
    return min(heights.values()), halo


def _leaf(trace: Trace, name: str) -> Leaf | None:
    leaves = trace.leaves.get(name, ())
    return leaves[0] if len(leaves) == 1 else None


def _image(trace: Trace, name: str) -> int:
    """The size of the split dimension of a node's value when it is one batch of 1-, 2- or 3-d
    images ``(N, C, ...)``, else 0."""
    leaf = _leaf(trace, name)
    if leaf is None or leaf.batch_dims != (0,) or leaf.rows != 1 or not 3 <= len(leaf.shape) <= 5:
        return 0
    return leaf.shape[SPLIT_DIM]


def _dims(tensor: Any) -> int:
    """Dimensions of a tensor argument, a node's as traced (4 when unknown)."""
    if isinstance(tensor, torch.Tensor):
        return tensor.dim()
    value = tensor.meta.get("val") if isinstance(tensor, fx.Node) else None
    return value.dim() if isinstance(value, torch.Tensor) else 4
