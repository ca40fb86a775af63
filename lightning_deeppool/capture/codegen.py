"""A layer as generated Python: its nodes compiled into one function, so running it costs what the
model's own forward costs instead of a dictionary lookup and argument mapping per node. Where the user
compiled the model (or the submodule the layer belongs to) with `torch.compile`, the function runs
through the same compiler."""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

from torch import fx

# What `torch.compile` gives (a compiled model's `dynamo_ctx`): wraps a function into its compiled form.
Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]


class CompiledLayer:
    """Evaluates a layer's `nodes` (graph order) from an environment of the node values it reads
    (by node name) and returns the values of `outputs`, as one generated function."""

    def __init__(
        self,
        module: fx.GraphModule,
        nodes: tuple[fx.Node, ...],
        outputs: tuple[str, ...],
        compiler: Compiler | None = None,
    ) -> None:
        inside = set(nodes)
        # Nodes evaluated before this layer (other layers' values, inputs, the batch size) become the
        # function's arguments, in the order the layer first reads them.
        read = dict.fromkeys(used for node in nodes for used in node.all_input_nodes if used not in inside)
        self.reads = [node.name for node in read]
        graph = fx.Graph()
        copies = {node: graph.placeholder(f"read_{i}") for i, node in enumerate(read)}
        for node in nodes:
            copies[node] = graph.node_copy(node, copies.__getitem__)
        by_name = {node.name: copy for node, copy in copies.items()}
        graph.output(tuple(by_name[name] for name in outputs))
        # The generated function runs with `self` = the live captured module, so it reads parameters,
        # buffers and submodules there at every call, as the interpreter does (never stale copies).
        run = types.MethodType(type(fx.GraphModule(module, graph)).forward, module)
        self._run: Callable[..., tuple[Any, ...]] = compiler(run) if compiler is not None else run

    def __call__(self, env: Mapping[str, Any]) -> tuple[Any, ...]:
        return self._run(*[env[name] for name in self.reads])


def compilable(nodes: tuple[fx.Node, ...]) -> bool:
    """Whether generated code runs these nodes as the interpreter does: nodes that ran without
    gradients at capture (``meta["no_grad"]``) need the interpreter's grad mode switch."""
    return not any(node.meta.get("no_grad") for node in nodes)
