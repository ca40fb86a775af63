"""Graph capture: trace a module's forward with torch.fx and cut it into layers.

A *layer* is a node whose output carries the batch dimension first (a tensor, or a tuple/list/dict
of such tensors). Every other node is *auxiliary*: shape arithmetic (`x.size(0)`), parameter
lookups, constants. Auxiliary nodes are evaluated inside each layer that needs them, so a layer
always sees the shapes of its own shard of the batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from lightning_deeppool.planner.graph import GraphInput, Layer, LayerGraph


class CaptureError(RuntimeError):
    """The module cannot be cut into layers; the message says what to change."""


@dataclass(frozen=True)
class LeafMeta:
    """Per-sample shape and dtype of one tensor in a batch value."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ValueMeta:
    """Structure of a batch value: its pytree spec and one `LeafMeta` per tensor leaf."""

    spec: pytree.TreeSpec
    leaves: tuple[LeafMeta, ...]

    @property
    def sample_bytes(self) -> int:
        return sum(_numel(leaf.shape) * leaf.dtype.itemsize for leaf in self.leaves)


@dataclass
class CapturedGraph:
    """A traced module cut into layers.

    `module` shares its parameters with the traced module. `layer_nodes[name]` lists the fx nodes
    a layer evaluates, auxiliary ones first and the layer's own node last; `layer_params[name]` the
    qualified names of the parameters it uses; `meta` the per-sample structure of every batch value
    (layers and batch inputs), as seen on the example batch.
    """

    module: fx.GraphModule
    graph: LayerGraph
    layer_nodes: dict[str, list[fx.Node]]
    layer_params: dict[str, list[str]]
    batch_inputs: list[str]
    local_inputs: list[str]
    meta: dict[str, ValueMeta]
    signature: inspect.Signature

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Map forward arguments to placeholder names (defaults filled in)."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"arguments do not match the traced forward{self.signature}: {err}") from None
        values = dict(bound.arguments)
        env: dict[str, Any] = {}
        for node in self.module.graph.nodes:
            if node.op != "placeholder":
                continue
            if node.target in values:
                env[node.name] = values[node.target]
            elif node.args:
                env[node.name] = node.args[0]
            else:
                raise TypeError(f"forward argument {node.target!r} is missing")
        return env


def evaluate(module: fx.GraphModule, node: fx.Node, env: dict[str, Any]) -> Any:
    """Run one call/get_attr node with its arguments looked up in `env` (by node name)."""
    args = fx.node.map_arg(node.args, lambda n: env[n.name])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n.name])
    target = node.target
    if node.op == "call_function" and callable(target):
        return target(*args, **kwargs)
    if not isinstance(target, str):
        raise ValueError(f"fx node {node.name!r} ({node.op}) has a non-string target {target!r}")
    if node.op == "call_module":
        return module.get_submodule(target)(*args, **kwargs)
    if node.op == "call_method":
        receiver, *rest = args
        return getattr(receiver, target)(*rest, **kwargs)
    if node.op == "get_attr":
        return _fetch_attr(module, target)
    raise ValueError(f"cannot evaluate fx node {node.name!r} with op {node.op!r}")


def _fetch_attr(module: nn.Module, target: str) -> Any:
    value: Any = module
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


class _LayerTracer(fx.Tracer):
    """Treats torch.nn modules and the user's `leaf_modules` as leaves; remembers where it is."""

    def __init__(self, leaf_modules: Sequence[str]) -> None:
        super().__init__()
        self.leaf_modules = tuple(leaf_modules)
        self.path: list[str] = []
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if any(
            module_qualified_name == leaf or module_qualified_name.startswith(leaf + ".")
            for leaf in self.leaf_modules
        ):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        self.path.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            # The innermost submodule being traced when tracing failed; outer frames keep it.
            if self.failed_in is None:
                self.failed_in = self.path[-1]
            raise
        finally:
            self.path.pop()


def capture_graph(
    module: nn.Module,
    example_args: Sequence[Any],
    example_kwargs: dict[str, Any] | None = None,
    *,
    leaf_modules: Sequence[str] = (),
) -> CapturedGraph:
    """Trace `module.forward` and cut it into layers, using the example batch for shapes.

    Tensor arguments are batches (dimension 0 is the sample); other arguments are passed through.
    Raises `CaptureError` naming the construct that failed and what to do.
    """
    example_kwargs = example_kwargs or {}
    # The class's forward: the strategy may have replaced the instance's `forward` attribute.
    signature = inspect.signature(type(module).forward.__get__(module))
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()):
        raise CaptureError(
            f"{type(module).__name__}.forward takes *args; deeppool needs named forward arguments"
        )
    bound = signature.bind(*example_args, **example_kwargs)
    concrete = {
        name: param.default
        for name, param in signature.parameters.items()
        if name not in bound.arguments and param.default is not inspect.Parameter.empty
    }
    tracer = _LayerTracer(leaf_modules)
    try:
        traced = tracer.trace(module, concrete_args=concrete or None)
    except Exception as err:
        raise CaptureError(_trace_failure_message(module, tracer.failed_in, err)) from err
    graph_module = fx.GraphModule(module, traced)
    captured = _cut_into_layers(graph_module, signature, bound.arguments)
    return captured


def _trace_failure_message(module: nn.Module, where: str | None, err: Exception) -> str:
    if where:
        submodule = module.get_submodule(where)
        return (
            f"torch.fx could not trace submodule {where!r} ({type(submodule).__name__}): {err}\n"
            f"Mark it as a leaf so it is planned as one layer: "
            f"DeepPoolStrategy(leaf_modules=[{where!r}]) (or `deeppool plan --leaf {where}`)."
        )
    return (
        f"torch.fx could not trace {type(module).__name__}.forward: {err}\n"
        "Data-dependent control flow in forward cannot be traced. Move it into training_step, or "
        "point the planner at the traceable part with DeepPoolStrategy(module='<submodule name>')."
    )


def _cut_into_layers(
    gm: fx.GraphModule, signature: inspect.Signature, example: dict[str, Any]
) -> CapturedGraph:
    small = _run_all(gm, signature, example, batch=2)
    large = _run_all(gm, signature, example, batch=3)
    kinds: dict[str, str] = {}
    meta: dict[str, ValueMeta] = {}
    batch_dependent: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        reads_batch = any(n.name in batch_dependent for n in node.all_input_nodes)
        kind, value_meta = _classify(node, small[node.name], large[node.name], reads_batch)
        kinds[node.name] = kind
        if kind == "batch" or reads_batch:
            batch_dependent.add(node.name)
        if value_meta is not None:
            meta[node.name] = value_meta

    batch_inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder" and kinds[n.name] == "batch"]
    local_inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder" and kinds[n.name] != "batch"]
    layers: list[Layer] = []
    layer_nodes: dict[str, list[fx.Node]] = {}
    layer_params: dict[str, list[str]] = {}
    counted: set[str] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output") or kinds[node.name] != "batch":
            if kinds.get(node.name) == "reduction":
                raise CaptureError(
                    f"node {node.name!r} ({_describe(node)}) turns batch tensors into a tensor without a "
                    "batch dimension inside forward (a reduction over samples). deeppool splits the batch "
                    "across devices: return per-sample outputs and reduce in training_step instead."
                )
            continue
        nodes = [*_auxiliary_closure(node, kinds), node]
        reads = _batch_reads(nodes, kinds)
        params = _parameters_used(gm, nodes)
        fresh = [p for p in params if p not in counted]
        counted.update(fresh)
        tensors = dict(gm.named_parameters())
        layers.append(
            Layer(
                name=node.name,
                op=node.op,
                target=node.target if isinstance(node.target, str) else _qualified(node.target),
                inputs=tuple(reads),
                sample_bytes=meta[node.name].sample_bytes,
                params=sum(tensors[p].numel() for p in fresh),
                param_bytes=sum(tensors[p].numel() * tensors[p].element_size() for p in fresh),
            )
        )
        layer_nodes[node.name] = nodes
        layer_params[node.name] = params
    outputs = _output_names(gm, kinds)
    graph = LayerGraph(
        inputs=tuple(GraphInput(name, meta[name].sample_bytes) for name in batch_inputs),
        layers=tuple(layers),
        outputs=tuple(outputs),
    )
    return CapturedGraph(
        module=gm,
        graph=graph,
        layer_nodes=layer_nodes,
        layer_params=layer_params,
        batch_inputs=batch_inputs,
        local_inputs=local_inputs,
        meta=meta,
        signature=signature,
    )


@contextmanager
def _evaluation_mode(module: nn.Module) -> Iterator[None]:
    """Eval mode, no grad, RNG untouched; every submodule's training flag restored afterwards."""
    flags = {m: m.training for m in module.modules()}
    module.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            yield
    finally:
        for m, flag in flags.items():
            m.training = flag


def repeat_first_sample(value: Any, batch_size: int) -> Any:
    """Repeat the first sample of every tensor leaf to `batch_size` samples."""

    def repeat(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf[:1].expand(batch_size, *leaf.shape[1:]).contiguous()
        return leaf

    return pytree.tree_map(repeat, value)


def _run_all(
    gm: fx.GraphModule, signature: inspect.Signature, example: dict[str, Any], batch: int
) -> dict[str, Any]:
    values = {name: repeat_first_sample(v, batch) for name, v in example.items()}
    env: dict[str, Any] = {}
    with _evaluation_mode(gm):
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                if node.target in values:
                    env[node.name] = values[node.target]
                else:
                    env[node.name] = node.args[0] if node.args else None
            elif node.op != "output":
                try:
                    env[node.name] = evaluate(gm, node, env)
                except Exception as err:
                    raise CaptureError(
                        f"running the example batch through node {node.name!r} ({_describe(node)}) "
                        f"failed: {err}"
                    ) from err
    return env


def _classify(node: fx.Node, small: Any, large: Any, reads_batch: bool) -> tuple[str, ValueMeta | None]:
    """'batch' (batch dimension first), 'local' (no batch tensors), or 'reduction'."""
    leaves_small, spec = pytree.tree_flatten(small)
    leaves_large, _ = pytree.tree_flatten(large)
    tensors = [(a, b) for a, b in zip(leaves_small, leaves_large) if isinstance(a, torch.Tensor)]
    if not tensors:
        return "local", None
    batched = [a.dim() > 0 and a.shape[0] == 2 and b.shape[0] == 3 for a, b in tensors]
    if all(batched) and len(tensors) == len(leaves_small) and node.op != "get_attr":
        for a, b in tensors:
            if a.shape[1:] != b.shape[1:]:
                raise CaptureError(
                    f"node {node.name!r} ({_describe(node)}) has a per-sample shape that depends on the "
                    f"batch size ({tuple(a.shape)} at 2 samples, {tuple(b.shape)} at 3): it mixes samples, "
                    "which deeppool cannot split across devices"
                )
        leaves = tuple(LeafMeta(tuple(a.shape[1:]), a.dtype) for a, _ in tensors)
        return "batch", ValueMeta(spec, leaves)
    if any(batched) and node.op != "get_attr":
        raise CaptureError(
            f"node {node.name!r} ({_describe(node)}) returns a mix of batch and non-batch values (or a "
            "batch dimension that is not first); mark the module that produces it as a leaf together "
            "with its consumer, or make dimension 0 the batch"
        )
    if reads_batch:
        return "reduction", None
    return "local", None


def _auxiliary_closure(node: fx.Node, kinds: dict[str, str]) -> list[fx.Node]:
    """Auxiliary nodes `node` depends on through auxiliary paths, in graph order."""
    found: dict[fx.Node, None] = {}
    stack = [n for n in node.all_input_nodes]
    while stack:
        current = stack.pop()
        if current.op == "placeholder" or kinds[current.name] == "batch" or current in found:
            continue
        found[current] = None
        stack.extend(current.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _batch_reads(nodes: list[fx.Node], kinds: dict[str, str]) -> list[str]:
    reads: dict[str, None] = {}
    inside = set(nodes)
    for n in nodes:
        for source in n.all_input_nodes:
            if source not in inside and kinds[source.name] == "batch":
                reads[source.name] = None
    return list(reads)


def _parameters_used(gm: fx.GraphModule, nodes: list[fx.Node]) -> list[str]:
    names = {id(p): name for name, p in gm.named_parameters()}
    used: dict[str, None] = {}
    for n in nodes:
        if n.op == "call_module":
            for p in gm.get_submodule(str(n.target)).parameters():
                used[names[id(p)]] = None
        elif n.op == "get_attr":
            value = _fetch_attr(gm, str(n.target))
            if isinstance(value, nn.Parameter):
                used[names[id(value)]] = None
            elif isinstance(value, nn.Module):
                for p in value.parameters():
                    used[names[id(p)]] = None
    return list(used)


def _output_names(gm: fx.GraphModule, kinds: dict[str, str]) -> list[str]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    names: dict[str, None] = {}
    for source in output.all_input_nodes:
        if kinds[source.name] != "batch":
            raise CaptureError(
                f"forward returns {source.name!r} ({_describe(source)}), which is not a batch tensor; "
                "deeppool returns outputs to the ranks holding their samples, so forward must return "
                "tensors (or tuples/dicts of tensors) with the batch dimension first"
            )
        names[source.name] = None
    return list(names)


def _describe(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else _qualified(node.target)
    return f"{node.op} {target}"


def _qualified(fn: Any) -> str:
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__name__", None) or repr(fn)
    if module.startswith("torch"):
        return f"torch.{name}"
    return f"{module}.{name}" if module and module not in ("builtins", "_operator", "operator") else name


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def propagate_meta(captured: CapturedGraph, env: dict[str, Any]) -> dict[str, ValueMeta]:
    """Per-sample structure of every batch value for inputs shaped like `env`'s, under the current
    autocast state (which decides dtypes). Runs the graph on two all-zero samples, so every rank
    gets the same answer whatever its own batch holds."""
    zeros = {
        name: pytree.tree_map(
            lambda leaf: leaf.new_zeros((2, *leaf.shape[1:])) if isinstance(leaf, torch.Tensor) else leaf,
            value,
        )
        if name in captured.batch_inputs
        else value
        for name, value in env.items()
    }
    values: dict[str, Any] = dict(zeros)
    gm = captured.module
    with _evaluation_mode(gm):
        for node in gm.graph.nodes:
            if node.op not in ("placeholder", "output"):
                values[node.name] = evaluate(gm, node, values)
    meta = {}
    for name in captured.meta:
        leaves, spec = pytree.tree_flatten(values[name])
        meta[name] = ValueMeta(spec, tuple(LeafMeta(tuple(t.shape[1:]), t.dtype) for t in leaves))
    return meta
