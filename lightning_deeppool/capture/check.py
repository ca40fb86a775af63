"""Checks a capture must pass before anything is planned on it: never a silent difference.

`check_replay`: evaluated layer by layer, the captured graph reproduces the module's own forward (its
outputs and its buffers afterwards) on the example batch. `check_per_sample`: no layer's output for one
sample changes when another sample of the batch changes; batch statistics (BatchNorm in training) are
the documented exception, so this check evaluates them with running statistics. Graph breaks
(`Layer.own_samples`) are the other: they run on each rank's own samples, as DDP runs them, so the
layers after one are checked on the same values of it for that sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from lightning_deeppool.capture.graph import BATCH_SIZE, CapturedGraph, evaluate, preserved
from lightning_deeppool.capture.trace import Break, CaptureError, describe, where
from lightning_deeppool.capture.values import LeafMeta, samples_view, take_samples

_TRAINING_ARGUMENT = 5  # `training` of aten.batch_norm, torch.batch_norm and F.batch_norm
_SEED = 1234


def check_replay(captured: CapturedGraph, module: nn.Module, mapping: dict[str, Any]) -> None:
    """Raise `CaptureError` if the layer-by-layer evaluation differs from ``module(**mapping)``."""
    with torch.no_grad(), preserved(module):
        torch.manual_seed(_SEED)
        expected = pytree.tree_leaves(type(module).forward(module, **mapping))
        buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    inputs = captured.bind((), mapping)
    batch = _batch_size(captured, inputs)
    scalars = {name: inputs[name] for name in captured.scalar_inputs}
    with torch.no_grad(), preserved(module):
        torch.manual_seed(_SEED)
        values = captured.run_all({n: inputs[n] for n in captured.batch_inputs}, batch, scalars)
        actual = pytree.tree_leaves(captured.forward_outputs(values, batch, scalars))
        after = {name: b.detach().clone() for name, b in module.named_buffers()}
    for i, (a, b) in enumerate(zip(expected, actual)):
        if isinstance(a, torch.Tensor) and not _close(a, b):
            raise CaptureError(
                f"the captured graph does not reproduce forward: output leaf {i} differs "
                f"(max difference {max_difference(a, b):.3g}); "
                "the model has code deeppool's capture cannot replay"
            )
    for name, value in buffers.items():
        if not _close(value, after[name]):
            raise CaptureError(
                f"the captured graph does not update buffer {name!r} as forward does; forward probably "
                "reassigns or updates it outside torch operations. Update buffers in place "
                f"(self.{name.rpartition('.')[2]}.copy_(...))"
            )


def check_per_sample(captured: CapturedGraph, module: nn.Module, mapping: dict[str, Any]) -> None:
    """Raise `CaptureError` naming the first node whose output for sample 0 depends on sample 1."""
    inputs = captured.bind((), mapping)
    batch = {name: inputs[name] for name in captured.batch_inputs}
    count = _batch_size(captured, inputs)
    if count < 3:
        return  # no second distinct sample to swap in
    first = {name: take_samples(value, 2) for name, value in batch.items()}
    other = {name: value[torch.tensor([0, 2])] for name, value in batch.items()}
    scalars = {name: inputs[name] for name in captured.scalar_inputs}
    broken = _break_outputs(captured)
    runs: list[dict[str, Any]] = []
    with torch.no_grad(), preserved(module):
        for values in (first, other):
            torch.manual_seed(_SEED)
            runs.append(_run_nodes(captured, values, scalars, broken, runs[0] if runs else None))
    for node in captured.module.graph.nodes:
        leaves = _batch_leaves(captured, node)
        if not leaves or node.name not in runs[0] or node.name in broken:
            continue
        a, b = pytree.tree_leaves(runs[0][node.name]), pytree.tree_leaves(runs[1][node.name])
        for x, y, leaf in zip(a, b, leaves):
            if not _close(samples_view(x, leaf)[:1], samples_view(y, leaf)[:1]):
                layer = next((n for n, code in captured.code.items() if node in code.nodes), "?")
                raise CaptureError(
                    f"layer {layer!r} mixes samples: the output of node {node.name!r} ({describe(node)})"
                    f"{where(node)} for one sample changes when another sample of the batch changes. "
                    "deeppool splits the batch across devices, so forward must treat samples independently "
                    "(BatchNorm is the documented exception); move batch-level computations into "
                    "training_step"
                )


def _break_outputs(captured: CapturedGraph) -> dict[str, tuple[Break, list[LeafMeta]]]:
    """The nodes of graph breaks' layers, with their break and their leaves where other layers read
    them."""
    by_path = {found.path: found for found in captured.breaks}
    found: dict[str, tuple[Break, list[LeafMeta]]] = {}
    for layer in captured.graph.layers:
        if layer.own_samples:
            for node in captured.code[layer.name].nodes:
                found[node.name] = (by_path[layer.module or ""], _batch_leaves(captured, node) or [])
    return found


def _run_nodes(
    captured: CapturedGraph,
    inputs: Mapping[str, Any],
    scalars: Mapping[str, Any],
    broken: Mapping[str, tuple[Break, list[LeafMeta]]],
    first: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """Every node's value in graph order, batch statistics taken from running statistics; where `first`
    (an earlier run) is given, the graph breaks' values for sample 0 are taken from it."""
    env: dict[str, Any] = {BATCH_SIZE: 2, **scalars, **inputs}
    gm = captured.module
    modes = {m: m.training for m in gm.modules()}
    try:
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "call_module":
                gm.get_submodule(str(node.target)).eval()
            env[node.name] = _evaluate_without_batch_statistics(gm, node, env)
            if first is not None and node.name in broken and broken[node.name][1]:
                found, leaves = broken[node.name]
                mine_leaves, their_leaves = (
                    pytree.tree_leaves(env[node.name]),
                    pytree.tree_leaves(first[node.name]),
                )
                for mine, theirs, leaf in zip(mine_leaves, their_leaves, leaves):
                    if mine.shape != theirs.shape:  # the call around it returns what later layers read
                        raise found.widened(
                            f"its output's per-sample shape depends on the data ({tuple(theirs.shape[1:])} "
                            f"for one pair of samples, {tuple(mine.shape[1:])} for another)"
                        )
                    samples_view(mine, leaf)[:1] = samples_view(theirs, leaf)[:1]
    finally:
        for m, flag in modes.items():
            m.training = flag
    return env


def _evaluate_without_batch_statistics(gm: fx.GraphModule, node: fx.Node, env: dict[str, Any]) -> Any:
    name = getattr(getattr(node.target, "overloadpacket", node.target), "__name__", "")
    if name != "batch_norm" or len(node.args) <= _TRAINING_ARGUMENT:
        return evaluate(gm, node, env)
    args = list(fx.node.map_arg(node.args, lambda n: env[n.name]))
    args[_TRAINING_ARGUMENT] = False
    kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n.name])
    return node.target(*args, **kwargs)  # type: ignore[operator]


def _batch_leaves(captured: CapturedGraph, node: fx.Node) -> list[LeafMeta] | None:
    for name, code in captured.code.items():
        if node.name in code.outputs:
            index = code.outputs.index(node.name)
            meta = captured.meta[name]
            if meta.per_rank:
                return None
            sizes = [len(pytree.tree_leaves(_structure_of(captured, o))) for o in code.outputs]
            start = sum(sizes[:index])
            return list(meta.leaves[start : start + sizes[index]])
    return None


def _structure_of(captured: CapturedGraph, name: str) -> Any:
    for node in captured.module.graph.nodes:
        if node.name == name:
            value = node.meta.get("val")
            return value if value is not None else 0
    return 0


def _batch_size(captured: CapturedGraph, inputs: Mapping[str, Any]) -> int:
    first = captured.batch_inputs[0]
    return inputs[first].shape[0]


def _close(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a == b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    return bool(torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5, equal_nan=True))


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise difference (infinite when the shapes differ)."""
    if a.shape != b.shape:
        return float("inf")
    return (a.float() - b.float()).abs().max().item()
