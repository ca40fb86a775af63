"""Run a captured layer on one part of spatially split samples (the runtime of a `spatial` placement).

Convolutions and max pooling first gather their halo (`halo.windowed`), BatchNorm reduces its
statistics over the parts (`batch_norm.split_batch_norm`), and pointwise operations, adds and
channel concatenations run on the part as they are (`capture.split_rules` has the rules). Any other
operation on a split value is refused with the operation's name: the parts must be gathered before
such a layer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_deeppool.capture import CapturedGraph
from lightning_deeppool.capture.graph import BATCH_SIZE, evaluate, unpack
from lightning_deeppool.capture.split_rules import (
    BATCH_NORM,
    CONCATENATION,
    CONVOLUTIONS,
    MAX_POOLINGS,
    arguments,
    pair,
    refusal,
    window,
)
from lightning_deeppool.ir.rows import SPLIT_DIM, Window
from lightning_deeppool.spatial.batch_norm import split_batch_norm
from lightning_deeppool.spatial.halo import Params, windowed
from lightning_deeppool.spatial.part import SpatialPart

aten = torch.ops.aten


def run_layer_split(
    captured: CapturedGraph,
    name: str,
    values: Mapping[str, Any],
    batch_size: int,
    scalars: Mapping[str, Any],
    part: SpatialPart,
    sizes: Mapping[str, int],
) -> tuple[Any, dict[str, int]]:
    """Layer `name` on this part, like `CapturedGraph.run_layer`. `sizes` gives the whole size along
    `SPLIT_DIM` of every split value the layer reads (by node name); returns the layer's value and the
    whole sizes of its split outputs."""
    code = captured.code[name]
    env: dict[str, Any] = {BATCH_SIZE: batch_size, **scalars}
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


def _convolution(target: Any, a: Mapping[str, Any], part: SpatialPart, size: int) -> tuple[Any, int]:
    rows = window(aten.conv2d.default, a, a["weight"].shape[SPLIT_DIM])
    padding = [0, *pair(a["padding"], a["weight"].dim() - 2)[1:]]
    kernel = Convolution(target, rows, list(a["stride"]), padding, list(a["dilation"]), a["groups"])
    out = windowed(a["input"], kernel, (a["weight"], a["bias"]), dim=SPLIT_DIM, size=size, part=part)
    return out, rows.output_size(size)


def _max_pooling(a: Mapping[str, Any], part: SpatialPart, size: int) -> tuple[Any, int]:
    rows = window(aten.max_pool2d.default, a)
    dims = a["input"].dim() - 2
    kernel_size = pair(a["kernel_size"], dims)
    stride = pair(a["stride"], dims) if len(a["stride"]) else kernel_size
    padding = [0, *pair(a["padding"], dims)[1:]]
    kernel = MaxPooling(rows, kernel_size, stride, padding, pair(a["dilation"], dims), a["ceil_mode"])
    return windowed(a["input"], kernel, (), dim=SPLIT_DIM, size=size, part=part), rows.output_size(size)


@dataclass(frozen=True)
class Convolution:
    """A 1-, 2- or 3-d convolution as a `halo.PaddedKernel`: unpadded along the split dimension unless
    `padded`. `op` is the graph's (``aten.conv2d``...), which autocast casts as it would on one
    device."""

    op: Any
    window: Window
    stride: list[int]
    padding: list[int]
    dilation: list[int]
    groups: int
    fill: float = 0.0

    def forward(self, slab: torch.Tensor, params: Params) -> tuple[torch.Tensor, Any]:
        weight, bias = params
        out = self.op(slab, weight, bias, self.stride, self.padding, self.dilation, self.groups)
        return out, None

    def padded(self, rows: int) -> Convolution:
        return dataclasses.replace(self, padding=[rows, *self.padding[1:]])

    def halo_grads(
        self, grad: torch.Tensor, halo: torch.Tensor, params: Params, wanted: Sequence[bool]
    ) -> tuple[torch.Tensor | None, Params]:
        # The weight's gradient is linear in the input; the bias's does not read it (counted once).
        grad_slab, grad_weight, _ = self.grads(grad, halo, params, [wanted[0], wanted[1], False])
        return grad_slab, (grad_weight, None)

    def grads(
        self, grad: torch.Tensor, x: torch.Tensor, params: Params, wanted: Sequence[bool]
    ) -> tuple[torch.Tensor | None, ...]:
        weight, bias = params
        assert weight is not None
        mask = [wanted[0], wanted[1], wanted[2] and bias is not None]
        if not any(mask):
            return (None, None, None)
        sizes = None if bias is None else [weight.shape[0]]
        grad_x, grad_weight, grad_bias = self._backward(
            grad, x.to(grad.dtype), weight.to(grad.dtype), sizes, mask
        )
        return (
            grad_x.to(x.dtype) if grad_x is not None else None,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if bias is not None and grad_bias is not None else None,
        )

    def input_grad(self, grad: torch.Tensor, shape: torch.Size, params: Params, saved: Any) -> torch.Tensor:
        weight = params[0]
        assert weight is not None
        # The input's values are not needed for its gradient: an uninitialized tensor of its shape.
        grad_slab = self._backward(
            grad, grad.new_empty(shape), weight.to(grad.dtype), None, [True, False, False]
        )[0]
        assert grad_slab is not None
        return grad_slab

    def param_grads(
        self,
        grad: torch.Tensor,
        slab: Callable[[], torch.Tensor],
        params: Params,
        saved: Any,
        wanted: Sequence[bool],
    ) -> Params:
        weight, bias = params
        assert weight is not None
        mask = [False, wanted[0], wanted[1] and bias is not None]
        if not any(mask):
            return (None, None)
        sizes = None if bias is None else [weight.shape[0]]
        _, grad_weight, grad_bias = self._backward(grad, slab(), weight.to(grad.dtype), sizes, mask)
        return (
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if bias is not None and grad_bias is not None else None,
        )

    def _backward(
        self,
        grad: torch.Tensor,
        slab: torch.Tensor,
        weight: torch.Tensor,
        bias_sizes: list[int] | None,
        mask: list[bool],
    ) -> tuple[torch.Tensor | None, ...]:
        return tuple(
            aten.convolution_backward(
                grad,
                slab,
                weight,
                bias_sizes,
                self.stride,
                self.padding,
                self.dilation,
                False,
                [0],
                self.groups,
                mask,
            )
        )


@dataclass(frozen=True)
class MaxPooling:
    """A 2- or 3-d max pooling as a `halo.Kernel`: padding rows hold -inf (a ceil-mode window's
    rows past the input too, which a max ignores as the kernel does)."""

    window: Window
    kernel_size: list[int]
    stride: list[int]
    padding: list[int]
    dilation: list[int]
    ceil_mode: bool = False  # for the other dimensions: the slab's rows fit whole windows
    fill: float = float("-inf")

    def forward(self, slab: torch.Tensor, params: Params) -> tuple[torch.Tensor, Any]:
        pool = aten.max_pool2d_with_indices if len(self.kernel_size) == 2 else aten.max_pool3d_with_indices
        out, indices = pool(slab, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)
        return out, indices

    def input_grad(self, grad: torch.Tensor, shape: torch.Size, params: Params, saved: Any) -> torch.Tensor:
        # The kernel reads only the input's shape: an uninitialized tensor spares rebuilding the slab.
        pool = (
            aten.max_pool2d_with_indices_backward
            if len(self.kernel_size) == 2
            else aten.max_pool3d_with_indices_backward
        )
        shaped = grad.new_empty(shape)
        return pool(
            grad, shaped, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode, saved
        )

    def param_grads(
        self,
        grad: torch.Tensor,
        slab: Callable[[], torch.Tensor],
        params: Params,
        saved: Any,
        wanted: Sequence[bool],
    ) -> Params:
        return ()


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
        part=part,
    )
    return out, size


def _concatenation(a: Mapping[str, Any], part: SpatialPart, size: int) -> tuple[Any, int]:
    return torch.cat(a["tensors"], a["dim"]), size


_RULES: dict[Any, Callable[[Mapping[str, Any], SpatialPart, int], tuple[Any, int]]] = {
    **{op: functools.partial(_convolution, op) for op in CONVOLUTIONS},
    **dict.fromkeys(MAX_POOLINGS, _max_pooling),
    BATCH_NORM: _batch_norm,
    CONCATENATION: _concatenation,
}
