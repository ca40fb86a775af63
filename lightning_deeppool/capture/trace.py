"""The trace both tracers produce: one fx graph of the forward and, per node, the structure of its value.

The graph's placeholders are ``batch_size`` (the number of samples the evaluating layer holds) and one
per tensor leaf of the forward's arguments. Parameters and buffers are ``get_attr`` nodes naming the
planned module's own tensors, so gradients and in-place buffer updates reach them. Every integer that
grows with the batch is an `affine` node of ``batch_size``: a layer evaluated on its shard of the batch
computes its shapes from that shard.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import fx
from torch.utils import _pytree as pytree

BATCH_SIZE = "batch_size"


def affine(batch: int, scale: int, offset: int) -> int:
    """An integer that grows with the batch: ``scale * batch + offset``."""
    return scale * batch + offset


class CaptureError(RuntimeError):
    """The module cannot be cut into layers; the message says what to change."""


@dataclass(frozen=True)
class Break:
    """A submodule (`path`; ``""``: the planned module's whole forward) of type `kind` planned as one layer
    run as Python at full width on each rank's own samples, because of `reason` (what broke the graph,
    at which line)."""

    path: str
    kind: str
    reason: str
    outer: tuple[str, ...] = ()  # the submodule calls around it, outermost first

    def widened(self, reason: str) -> GraphBreak:
        """The graph break of this break's output (`reason`), to be made at the call around it."""
        return GraphBreak(f"graph break {self.path!r}: {reason}", (*self.outer, self.path), self.reason)

    def describe(self) -> str:
        """The one-line account rank 0 prints."""
        where = f"module {self.path!r} ({self.kind})" if self.path else f"{self.kind}.forward itself"
        cost = (
            "runs as Python at full width, on each rank's own samples, as DDP runs it; the layers before "
            "and after it keep their plan"
            if self.path
            else "trains data-parallel: every layer at full width, on each rank's own samples, as DDP"
        )
        return f"deeppool: graph break in {where}: {self.reason}. It {cost}"


def data_dependent_shape(where: str, found: Any, expected: Any) -> str:
    """The error of a graph break (`where`) whose output has per-sample shapes `found`, from the data,
    where the capture saw `expected`."""
    return (
        f"deeppool: graph break {where} (code run as Python) returned values of per-sample shapes {found} "
        f"where the capture saw {expected}: its output's shape depends on the data, so the layers after "
        "it cannot be planned. Return a shape fixed by the inputs' shapes (pad to a fixed length), or "
        "move that code into training_step"
    )


class GraphBreak(CaptureError):
    """Code the capture cannot represent (`reason`: what, and the user's line), run inside the submodule
    calls `stack` (paths, outermost first; empty for the planned module's own forward)."""

    def __init__(self, message: str, stack: tuple[str, ...], reason: str) -> None:
        super().__init__(message)
        self.stack, self.reason = stack, reason


class ModuleCall(NamedTuple):
    """One call of a submodule: its qualified name and which call of it this is (0, 1, ...)."""

    path: str
    occurrence: int


@dataclass(frozen=True)
class Leaf:
    """A tensor in a node's value. ``shape`` is taken at one sample; ``batch_dims`` lists the dimensions
    that grow with the batch (``rows`` per sample in each)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    batch_dims: tuple[int, ...]
    rows: int = 1


@dataclass
class Trace:
    """A forward as one graph (see the module docstring) with what the analysis needs per node.

    ``inputs`` names the placeholders of the tensor leaves of the call's arguments, ``input_spec`` the
    pytree spec of those arguments (a mapping of parameter names to values), ``leaf_names`` each
    leaf's placeholder (None for non-tensor leaves) and ``constants`` the non-tensor leaves (tensor
    positions None): a later call must match them.
    ``leaves[node]`` describes each leaf of a node's value (None for non-tensors), ``stacks[node]``
    the submodule calls it ran inside, outermost first.
    """

    gm: fx.GraphModule
    inputs: list[str]
    input_spec: pytree.TreeSpec
    leaf_names: list[str | None]
    constants: list[Any]
    output_spec: pytree.TreeSpec
    leaves: dict[str, tuple[Leaf | None, ...]]
    stacks: dict[str, tuple[ModuleCall, ...]]
    tracer: str
    guards: tuple[str, ...] = ()

    def node(self, name: str) -> fx.Node:
        for node in self.gm.graph.nodes:
            if node.name == name:
                return node
        raise KeyError(name)


def graph_module(attrs: dict[str, Any], graph: fx.Graph, buffers: set[str]) -> fx.GraphModule:
    """A GraphModule holding `attrs` by reference (the planned module's own parameters, buffers and
    submodules, and constants), with `buffers` registered as buffers so that state saving and
    restoring sees them. A user name that is also one of the GraphModule's own (``meta``, ``graph``,
    ``code``, ...) is held under another name."""
    attrs, buffers = _renamed(attrs, graph, buffers)
    gm = fx.GraphModule(attrs, graph)
    for target in buffers & attrs.keys():
        parent_name, _, name = target.rpartition(".")
        parent = gm.get_submodule(parent_name)
        value = getattr(parent, name)
        delattr(parent, name)
        parent.register_buffer(name, value)
    return gm


@functools.cache
def _reserved() -> frozenset[str]:
    """The names a GraphModule uses itself (methods, properties, attributes)."""
    return frozenset(dir(fx.GraphModule(torch.nn.Module(), fx.Graph())))


def _renamed(attrs: dict[str, Any], graph: fx.Graph, buffers: set[str]) -> tuple[dict[str, Any], set[str]]:
    """`attrs` and `buffers` with every top-level name the GraphModule reserves replaced by a free one,
    and the graph's nodes retargeted to match."""
    tops = {target.split(".")[0] for target in attrs}
    taken = set(tops) | _reserved()
    names = {}
    for top in sorted(tops & _reserved()):
        name, n = f"{top}_", 1
        while name in taken:
            name, n = f"{top}_{n}", n + 1
        taken.add(name)
        names[top] = name
    if not names:
        return attrs, buffers

    def rename(target: str) -> str:
        top, dot, rest = target.partition(".")
        return names.get(top, top) + dot + rest

    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            node.target = rename(str(node.target))
    return {rename(t): value for t, value in attrs.items()}, {rename(t) for t in buffers}


def input_names(mapping: dict[str, Any]) -> tuple[list[tuple[str, Any]], pytree.TreeSpec]:
    """The call's leaves with readable unique names (``x``, ``batch_image``), and its spec."""
    flat, spec = pytree.tree_flatten_with_path(mapping)
    named, seen = [], set()
    for path, leaf in flat:
        base = re.sub(r"\W+", "_", pytree.keystr(path)).strip("_") or "input"
        name, n = base, 1
        while name in seen or name == BATCH_SIZE:
            name, n = f"{base}_{n}", n + 1
        seen.add(name)
        named.append((name, leaf))
    return named, spec


def is_batch_input(leaf: Any) -> bool:
    """Tensor arguments with at least one dimension are batches (dimension 0 is the sample)."""
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0


def describe(node: fx.Node) -> str:
    """`op target` of a node, readable for error messages."""
    target = node.target
    if isinstance(target, str):
        return f"{node.op} {target}"
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    return f"{node.op} {name}"


def where(node: fx.Node) -> str:
    """The user's source line that produced a node, when the tracer recorded it."""
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    return f" ({lines[-2]}: {lines[-1]})" if len(lines) >= 2 else ""
