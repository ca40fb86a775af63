"""The captured forward cut into layers: what the planner, the profiler and the runtime share.

A layer is a run of graph nodes that reads batch values (graph inputs or other layers' values) and
produces one value: the tuple of its nodes that later layers or the forward's return read. Nodes that
do not depend on the batch's data (masks, position tables, shape arithmetic) are *auxiliary*: each
layer evaluates the ones it needs, with its own number of samples.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from lightning_deeppool.capture.codegen import CompiledLayer, Compiler, compilable
from lightning_deeppool.capture.state import ModuleState, call_key
from lightning_deeppool.capture.trace import BATCH_SIZE, Break, CaptureError
from lightning_deeppool.capture.values import LeafMeta, ValueMeta
from lightning_deeppool.ir.graph import LayerGraph, under


@dataclass(frozen=True)
class LayerCode:
    """How to evaluate one layer: `nodes` in graph order (auxiliary ones included), the nodes whose
    values make up its value (`outputs`), and for each layer or input it reads, the nodes it needs
    from that value (`reads`)."""

    nodes: tuple[fx.Node, ...]
    outputs: tuple[str, ...]
    reads: tuple[tuple[str, tuple[str, ...]], ...]


Evaluate = Callable[[dict[str, Any]], tuple[Any, ...]]  # node values read -> the values returned


@dataclass(frozen=True)
class CallSignature:
    """How a call's arguments become graph inputs: bind to `signature`, flatten, match `spec`; the
    non-tensor leaves (`constants`) the forward was captured with pick the graph, except those at
    positions `unread` (strings the graph does not depend on, such as file names in a batch dict)."""

    signature: inspect.Signature
    spec: pytree.TreeSpec
    constants: tuple[Any, ...]
    names: tuple[str | None, ...]  # per leaf: its graph input, None for non-tensor leaves
    unread: frozenset[int] = frozenset()

    def mapping(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        return call_mapping(self.signature, args, kwargs)

    @functools.cached_property
    def read(self) -> tuple[Any, ...]:
        """The non-tensor leaves the graph was captured for (`unread` ones left out)."""
        return tuple(
            c
            for i, (c, name) in enumerate(zip(self.constants, self.names))
            if name is None and i not in self.unread
        )


@dataclass
class CapturedGraph:
    """A captured forward cut into layers (see the module docstring).

    `module` holds the graph; its parameters and buffers are the planned module's own tensors.
    `batch_inputs` are the graph inputs that carry the batch (dimension 0), `scalar_inputs` the 0-d
    tensor arguments every layer receives as they are. `meta[name]` describes each layer's value and
    each batch input, as seen on the example batch. `guards` are the nodes that check branches the
    forward took at capture (with the nodes they read, in graph order), run once per call.
    `stochastic` and `batch_statistics` say whether the graph draws random numbers or normalizes by
    batch statistics. `state` is what else the forward read (module values, forward hooks): a call
    where it differs needs another graph.
    """

    module: fx.GraphModule
    graph: LayerGraph
    code: dict[str, LayerCode]
    layer_params: dict[str, list[str]]
    batch_inputs: list[str]
    scalar_inputs: list[str]
    meta: dict[str, ValueMeta]
    call: CallSignature
    outputs: list[Any]
    output_spec: pytree.TreeSpec
    tracer: str
    guards: tuple[fx.Node, ...] = ()
    stochastic: bool = False
    batch_statistics: bool = False
    compilers: tuple[tuple[str, Compiler], ...] = ()
    state: ModuleState = field(default_factory=ModuleState)
    hooked: tuple[str, ...] = ()  # submodules with forward hooks: forward returns (outputs, their outputs)
    breaks: tuple[Break, ...] = ()  # code it could not follow, run as Python (`Layer.own_samples`)
    _compiled: dict[str, Evaluate] = field(default_factory=dict, init=False, repr=False, compare=False)
    _stages: dict[tuple[tuple[str, ...], tuple[str, ...]], Evaluate | None] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @functools.cached_property
    def samples(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The per-sample shape and dtype of each batch input it was captured at (asked at every
        planned call)."""
        leaves = [self.meta[name].leaves[0] for name in self.batch_inputs]
        return [(leaf.shape, leaf.dtype) for leaf in leaves]

    @functools.cached_property
    def key(self) -> int:
        """What a call must match to run this graph: its per-sample shapes and the module values
        forward read (`call_key` of them at capture)."""
        return call_key(self.samples, (self.state.captured, self.call.read))

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Graph inputs of a call: ``{input name: tensor}``. Raises ValueError naming what differs
        from the captured call (structure, or a non-tensor argument the graph was captured for)."""
        env, read = self.split(args, kwargs)
        for expected, leaf in zip(self.call.read, read):
            if leaf is not expected and leaf != expected:
                raise ValueError(
                    f"forward was captured with the argument value {expected!r} and is now called with "
                    f"{leaf!r}, which needs another capture"
                )
        return env

    def split(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """Graph inputs of a call, and its non-tensor arguments at the positions the graph was captured
        for (`CallSignature.read`). Raises ValueError if the call's structure differs from the captured
        one's."""
        mapping = self.call.mapping(args, kwargs)
        leaves, spec = pytree.tree_flatten(mapping)
        if spec != self.call.spec:
            raise ValueError(
                f"forward was captured for arguments structured as {self.call.spec} and is now called with "
                f"{spec}; deeppool replays the captured forward, so every call must pass the same arguments"
            )
        env, read = {}, []
        for i, (leaf, name) in enumerate(zip(leaves, self.call.names)):
            if name is not None:
                if not isinstance(leaf, torch.Tensor):
                    raise ValueError(f"forward argument {name!r} was a tensor at capture and is now {leaf!r}")
                env[name] = leaf
            elif i not in self.call.unread:
                read.append(leaf)
        return env, tuple(read)

    def run_layer(
        self, name: str, values: Mapping[str, Any], batch_size: int, scalars: Mapping[str, Any]
    ) -> Any:
        """Evaluate layer `name` on `values` (the values of the layers and inputs it reads) for
        `batch_size` samples; returns its value (a tuple of its output nodes' values)."""
        code = self.code[name]
        env: dict[str, Any] = {BATCH_SIZE: batch_size, **scalars}
        for source, nodes in code.reads:
            unpack(self, source, values[source], env, nodes)
        run = self._compiled.get(name)
        if run is None:
            run = self._compiled[name] = self._compile(name, code)
        return run(env)

    def run_layers(
        self,
        layers: Sequence[str],
        outputs: Sequence[str],
        values: Mapping[str, Any],
        batch_size: int,
        scalars: Mapping[str, Any],
    ) -> dict[str, Any]:
        """Evaluate consecutive `layers` on `values` (the values of what they read from outside them)
        for `batch_size` samples and return the values of `outputs`, some of them: as one generated
        function (through their compiler, where they have one), else layer by layer."""
        key = (tuple(layers), tuple(outputs))
        if key not in self._stages:
            self._stages[key] = self._compile_stage(*key)
        run = self._stages[key]
        if run is None:
            found = self._one_by_one(layers, values, batch_size, scalars)
            return {name: found[name] for name in outputs}
        inside = set(layers)
        env: dict[str, Any] = {BATCH_SIZE: batch_size, **scalars}
        for name in layers:
            for source, nodes in self.code[name].reads:
                if source not in inside:
                    unpack(self, source, values[source], env, nodes)
        results, offset = {}, 0
        flat = run(env)
        for name in outputs:
            count = len(self.code[name].outputs)
            results[name] = flat[offset : offset + count]
            offset += count
        return results

    def _compile_stage(self, layers: tuple[str, ...], outputs: tuple[str, ...]) -> Evaluate | None:
        """Several layers as one generated function, where each could be one and they share a
        compiler: a stage launches once (one compiled graph), not once per layer."""
        nodes = tuple(dict.fromkeys(node for name in layers for node in self.code[name].nodes))
        compilers = {id(self._compiler(name)) for name in layers}
        if len(layers) < 2 or len(compilers) > 1 or not compilable(nodes):
            return None
        returned = tuple(output for name in outputs for output in self.code[name].outputs)
        return CompiledLayer(self.module, nodes, returned, self._compiler(layers[0]))

    def _compile(self, name: str, code: LayerCode) -> Evaluate:
        """The layer as generated code where that runs it as the interpreter does (through the user's
        compiler of its module, if any), else interpreted."""
        if compilable(code.nodes):
            return CompiledLayer(self.module, code.nodes, code.outputs, self._compiler(name))

        def interpreted(env: dict[str, Any]) -> tuple[Any, ...]:
            for node in code.nodes:
                env[node.name] = evaluate(self.module, node, env)
            return tuple(env[output] for output in code.outputs)

        return interpreted

    def _compiler(self, name: str) -> Compiler | None:
        """The compiler of the innermost compiled module holding layer `name` (by its module path)."""
        layer = self.graph.layer(name)
        path = layer.target if layer.op == "call_module" else ""
        found = [(prefix, compiler) for prefix, compiler in self.compilers if under(path, prefix)]
        return max(found, key=lambda item: len(item[0]))[1] if found else None

    def run_guards(self, scalars: Mapping[str, Any]) -> None:
        """Check the branches the forward took at capture still hold (raises `GuardError`)."""
        env: dict[str, Any] = {BATCH_SIZE: 1, **scalars}
        for node in self.guards:
            env[node.name] = evaluate(self.module, node, env)

    def forward_outputs(self, values: Mapping[str, Any], batch_size: int, scalars: Mapping[str, Any]) -> Any:
        """The forward's return value from the values of the layers and inputs it returns."""
        env: dict[str, Any] = {BATCH_SIZE: batch_size, **scalars}
        for name in self.graph.outputs:
            unpack(self, name, values[name], env)
        aux = _closure(self.outputs, env)
        for node in aux:
            env[node.name] = evaluate(self.module, node, env)
        leaves = [env[leaf.name] if isinstance(leaf, fx.Node) else leaf for leaf in self.outputs]
        return pytree.tree_unflatten(leaves, self.output_spec)

    def run_all(
        self, inputs: Mapping[str, Any], batch_size: int, scalars: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Every layer's value, evaluated in order on one device (the reference of the plan)."""
        return self._one_by_one([layer.name for layer in self.graph.layers], inputs, batch_size, scalars)

    def _one_by_one(
        self, layers: Sequence[str], values: Mapping[str, Any], batch_size: int, scalars: Mapping[str, Any]
    ) -> dict[str, Any]:
        """`values` with the values of `layers`, each evaluated on its own, in order."""
        found = dict(values)
        for name in layers:
            found[name] = self.run_layer(name, found, batch_size, scalars)
        return found


def unpack(
    captured: CapturedGraph, source: str, value: Any, env: dict[str, Any], nodes: Sequence[str] | None = None
) -> None:
    """Put the node values a layer's value (or a graph input) holds into `env`."""
    if source not in captured.code:
        env[source] = value
        return
    for output, part in zip(captured.code[source].outputs, value):
        if nodes is None or output in nodes:
            env[output] = part


def _closure(leaves: Sequence[Any], env: Mapping[str, Any]) -> list[fx.Node]:
    """Nodes not in `env` that the given output leaves need, in graph order."""
    found: dict[fx.Node, None] = {}
    stack = [leaf for leaf in leaves if isinstance(leaf, fx.Node) and leaf.name not in env]
    while stack:
        node = stack.pop()
        if node in found or node.name in env:
            continue
        found[node] = None
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(next(iter(found)).graph.nodes)} if found else {}
    return sorted(found, key=order.__getitem__)


def evaluate(module: fx.GraphModule, node: fx.Node, env: Mapping[str, Any]) -> Any:
    """Run one node with its arguments looked up in `env` (by node name)."""
    args = fx.node.map_arg(node.args, lambda n: env[n.name])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n.name])
    target = node.target
    if node.op == "get_attr":
        return fetch_attr(module, str(target))
    if node.op == "call_module":
        call: Any = module.get_submodule(str(target))
    elif node.op == "call_function" and callable(target):
        call = target
    else:
        raise ValueError(f"cannot evaluate fx node {node.name!r} with op {node.op!r}")
    if node.meta.get("no_grad"):
        with torch.no_grad():
            return call(*args, **kwargs)
    return call(*args, **kwargs)


def fetch_attr(module: nn.Module, target: str) -> Any:
    return functools.reduce(getattr, target.split("."), module)


def call_mapping(
    signature: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Arguments by parameter name, defaults filled in, ``**kwargs`` merged into the mapping."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"arguments do not match forward{signature}: {err}") from None
    bound.apply_defaults()
    mapping: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            mapping.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise CaptureError(f"forward takes *{name}; deeppool needs forward arguments passed by name")
        else:
            mapping[name] = value
    return mapping


@contextmanager
def preserved(module: nn.Module, device: torch.device | None = None) -> Iterator[None]:
    """Run code on `module` that must leave no trace: training flags, buffers and RNG are restored."""
    flags = {m: m.training for m in module.modules()}
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    devices = [device] if device is not None and device.type == "cuda" else []
    device_type = device.type if device is not None else "cpu"
    try:
        with torch.random.fork_rng(devices=devices, device_type=device_type):
            yield
    finally:
        with torch.no_grad():
            # Only buffers whose values changed are written back: a write bumps a buffer's version, and a
            # backward that saved it (position ids an embedding reads) fails if this ran before it.
            for name, b in module.named_buffers():
                if name in buffers and not _same(b, buffers[name]):
                    b.copy_(buffers[name])
        for m, flag in flags.items():
            m.training = flag


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def value_meta(value: Any, per_rank: bool = False, rows: Sequence[int] | None = None) -> ValueMeta:
    """Structure of a value evaluated at any number of samples (rows per sample per leaf)."""
    leaves, spec = pytree.tree_flatten(value)
    metas = []
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise CaptureError(f"a value between layers holds {type(leaf).__name__}, not only tensors")
        r = rows[i] if rows is not None else 1
        if per_rank:
            metas.append(LeafMeta(tuple(leaf.shape), leaf.dtype))
        elif r == 1:
            metas.append(LeafMeta(tuple(leaf.shape[1:]), leaf.dtype))
        else:
            metas.append(LeafMeta((r, *leaf.shape[1:]), leaf.dtype, r))
    return ValueMeta(spec, tuple(metas), per_rank)
