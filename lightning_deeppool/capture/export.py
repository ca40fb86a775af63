"""Capture with `torch.export` (non-strict): symbolic shapes, loud failures on data-dependent code.

The batch dimension of every tensor argument is one symbolic size; export runs the Python and records
ATen operations with `nn_module_stack` metadata. The exported program is rewritten into a `Trace`:
parameters and buffers become ``get_attr`` nodes of the planned module, symbolic integers become
`affine` nodes of ``batch_size``, buffer reassignments become in-place copies.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import sympy
import torch
from torch import fx, nn
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument
from torch.utils import _pytree as pytree

from lightning_deeppool.capture.trace import (
    BATCH_SIZE,
    CaptureError,
    Leaf,
    ModuleCall,
    Trace,
    affine,
    graph_module,
    input_names,
    is_batch_input,
)

_DROPPED = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


class DataDependentSize(RuntimeError):
    """A size the exported graph computes from the batch's data: the recording tracer locates it."""


def trace_with_export(module: nn.Module, mapping: dict[str, Any]) -> Trace:
    """Export ``module(**mapping)`` with a symbolic batch size and rewrite it as a `Trace`. Raises
    `DataDependentSize` for sizes computed from data, `CaptureError` for other sizes it cannot rescale."""
    batch = Dim("batch", min=1)
    dynamic = {
        name: pytree.tree_map(lambda leaf: {0: batch} if is_batch_input(leaf) else None, value)
        for name, value in mapping.items()
    }
    with _quiet(), _named_parameters(module, mapping):
        program = torch.export.export(module, (), mapping, dynamic_shapes=dynamic, strict=False)
    return _rewrite(program, mapping)


@contextlib.contextmanager
def _named_parameters(module: nn.Module, names: Iterable[str]) -> Iterator[None]:
    """Give ``module.forward`` one keyword parameter per name while exporting: export cannot make
    arguments gathered by ``**kwargs`` dynamic."""
    forward = module.forward
    parameters = inspect.signature(forward).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        yield
        return

    def named(**kwargs: Any) -> Any:
        return forward(**kwargs)

    keyword = inspect.Parameter.KEYWORD_ONLY
    named.__signature__ = inspect.Signature([inspect.Parameter(n, keyword) for n in names])  # type: ignore[attr-defined]
    own = module.__dict__.get("forward")
    module.forward = named  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own  # type: ignore[method-assign]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Export prints partial graphs and warnings when it fails; a failure here only means falling back."""
    names = [name for name in logging.root.manager.loggerDict if name.startswith("torch")]
    loggers = [logging.getLogger(name) for name in names]
    disabled = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, flag in zip(loggers, disabled):
            logger.disabled = flag


def _rewrite(program: ExportedProgram, mapping: dict[str, Any]) -> Trace:
    """The exported program as a `Trace` of the planned module (see the module docstring)."""
    named, input_spec = input_names(mapping)
    tensor_names = [name for name, leaf in named if isinstance(leaf, torch.Tensor)]
    graph = fx.Graph()
    batch_node = graph.placeholder(BATCH_SIZE)
    inputs = _Inputs(graph)
    inputs.add_all(program, tensor_names)
    _copy_body(program.graph_module.graph, graph, inputs.env, batch_node, inputs.symbol)
    _add_outputs(program, graph, inputs.env)
    gm = graph_module(inputs.attrs, graph, inputs.buffers)
    placed, symbol = inputs.placed, inputs.symbol
    return Trace(
        gm=gm,
        inputs=[placed[name] for name in tensor_names],
        input_spec=input_spec,
        leaf_names=[placed.get(name) if isinstance(leaf, torch.Tensor) else None for name, leaf in named],
        constants=[None if isinstance(leaf, torch.Tensor) else leaf for _, leaf in named],
        output_spec=program.call_spec.out_spec,
        leaves={n.name: _leaves(n.meta.get("val"), symbol, n) for n in gm.graph.nodes},
        stacks={n.name: _stack(n.meta.get("nn_module_stack")) for n in gm.graph.nodes},
        tracer="export",
    )


class _Inputs:
    """The exported program's inputs in `graph`: `env` maps each of its placeholders to its node there,
    `placed` each user input's name to its placeholder's; parameters, buffers and constant tensors are
    read from `attrs` (`buffers` names the buffers); `symbol` is the batch size's."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.env: dict[fx.Node, Any] = {}
        self.placed: dict[str, str] = {}
        self.attrs: dict[str, Any] = {}
        self.buffers: set[str] = set()
        self.symbol: Any = None

    def add_all(self, program: ExportedProgram, tensor_names: list[str]) -> None:
        """A placeholder per user tensor (named by `tensor_names`, in order), a ``get_attr`` node per
        parameter, buffer and constant tensor; raises `CaptureError` for other inputs, or if no input
        has a batch dimension."""
        placeholders = {n.name: n for n in program.graph_module.graph.nodes if n.op == "placeholder"}
        user = iter(tensor_names)
        for spec in program.graph_signature.input_specs:
            if not isinstance(spec.arg, TensorArgument):
                continue  # a constant argument: export baked its value in
            node = placeholders[spec.arg.name]
            if spec.kind == InputKind.USER_INPUT:
                self.env[node] = self._user_input(node, next(user))
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                self.env[node] = self._state_input(program, spec.kind, spec.target)
            else:
                raise CaptureError(
                    f"torch.export produced an input of kind {spec.kind.name}, which deeppool cannot run"
                )
            self.env[node].meta = dict(node.meta)
        if self.symbol is None:
            raise CaptureError(
                "forward takes no tensor with a batch dimension: there is nothing to split by sample"
            )

    def _user_input(self, node: fx.Node, name: str) -> fx.Node:
        """The placeholder of the user's tensor `name`; its batch dimension's symbol is the batch size's."""
        new = self.graph.placeholder(name)
        self.placed[name] = new.name
        shape = node.meta["val"].shape
        if shape and isinstance(shape[0], torch.SymInt):
            self.symbol = shape[0].node.expr
        return new

    def _state_input(self, program: ExportedProgram, kind: InputKind, target: str) -> fx.Node:
        """A ``get_attr`` node of a parameter, buffer or constant tensor (constants numbered here)."""
        name = target if kind != InputKind.CONSTANT_TENSOR else f"_deeppool_constant_{len(self.attrs)}"
        self.attrs[name] = _state(program, target)
        if kind == InputKind.BUFFER:
            self.buffers.add(name)
        return self.graph.get_attr(name)


def _copy_body(
    old: fx.Graph, graph: fx.Graph, env: dict[fx.Node, Any], batch_node: fx.Node, symbol: Any
) -> None:
    """Copy the exported graph's computation into `graph`, without export's runtime assertions; symbolic
    integers become `affine` nodes of the batch size."""
    for node in old.nodes:
        if node.op in ("placeholder", "output") or node.target in _DROPPED:
            continue
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
            env[node] = _integer(graph, batch_node, value, symbol, node)
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
        env[node].meta = dict(node.meta)


def _add_outputs(program: ExportedProgram, graph: fx.Graph, env: dict[fx.Node, Any]) -> None:
    """The user's outputs as `graph`'s, buffer mutations as in-place copies into the buffers; raises
    `CaptureError` if forward writes into its arguments."""
    output = next(n for n in program.graph_module.graph.nodes if n.op == "output")
    user_outputs = []
    for spec, result in zip(program.graph_signature.output_specs, list(output.args[0])):
        value = env[result] if isinstance(result, fx.Node) else result
        if spec.kind == OutputKind.USER_OUTPUT:
            user_outputs.append(value)
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            target = graph.get_attr(spec.target)
            copy = graph.call_function(torch.Tensor.copy_, (target, value))
            copy.meta = dict(result.meta) if isinstance(result, fx.Node) else {}
        else:
            raise CaptureError(
                f"forward modifies its input in place ({spec.kind.name}); deeppool moves inputs between "
                "ranks, so forward must not write into its arguments"
            )
    graph.output(user_outputs)


def _state(program: ExportedProgram, target: str) -> Any:
    if target in program.state_dict:
        return program.state_dict[target]
    return program.constants[target]


def _integer(graph: fx.Graph, batch_node: fx.Node, value: Any, symbol: Any, node: fx.Node) -> Any:
    """An integer node of the exported graph as an `affine` node of the batch size (or a constant)."""
    expr = sympy.sympify(value.node.expr)
    if expr.free_symbols - {symbol}:
        raise DataDependentSize(f"node {node.name!r} computes a size from data ({expr})")
    poly = sympy.Poly(expr, symbol) if expr.free_symbols else None
    if poly is None:
        return int(expr)
    if poly.degree() > 1 or not all(c.is_integer for c in poly.all_coeffs()):
        raise CaptureError(
            f"node {node.name!r} computes {expr} from the batch size {symbol}; deeppool splits the batch "
            "and can only rescale sizes that grow linearly with it"
        )
    coeffs = [int(c) for c in poly.all_coeffs()]
    scale, offset = (coeffs[0], coeffs[1]) if len(coeffs) == 2 else (0, coeffs[0])
    new = graph.call_function(affine, (batch_node, scale, offset))
    new.meta = dict(node.meta)
    return new


def _leaves(value: Any, symbol: Any, node: fx.Node) -> tuple[Leaf | None, ...]:
    return tuple(_leaf(leaf, symbol, node) for leaf in pytree.tree_leaves(value))


def _leaf(value: Any, symbol: Any, node: fx.Node) -> Leaf | None:
    if not isinstance(value, torch.Tensor):
        return None
    shape: list[int] = []
    batch_dims: list[int] = []
    rows = 1
    for dim, size in enumerate(value.shape):
        if isinstance(size, torch.SymInt):
            expr = sympy.sympify(size.node.expr)
            if expr.free_symbols - {symbol}:
                raise DataDependentSize(f"node {node.name!r} has a dimension of size {expr}, from data")
            scale = sympy.Poly(expr, symbol).all_coeffs() if expr.free_symbols == {symbol} else []
            if len(scale) != 2 or scale[1] != 0 or not scale[0].is_integer:
                raise CaptureError(
                    f"node {node.name!r} has a dimension of size {expr}; deeppool can only split "
                    "dimensions whose size is a multiple of the batch size"
                )
            rows = int(scale[0])
            batch_dims.append(dim)
            shape.append(rows)
        else:
            shape.append(int(size))
    return Leaf(value.dtype, tuple(shape), tuple(batch_dims), rows)


def _stack(meta: dict[str, tuple[str, Any]] | None) -> tuple[ModuleCall, ...]:
    if not meta:
        return ()
    calls = []
    for key, (path, _) in meta.items():
        if not path:
            continue
        _, _, index = key.rpartition("@")
        calls.append(ModuleCall(path, int(index) if "@" in key and index.isdigit() else 0))
    return tuple(calls)
