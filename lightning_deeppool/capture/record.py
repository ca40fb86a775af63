"""Capture by recording: run the forward on real tensors and record every torch call.

For models `torch.export` cannot take (a check such as ``torch.equal(mask, causal)`` on a constant,
``leaf_modules``). A `TorchFunctionMode` records each torch function and tensor method the forward calls,
with real arguments; ``leaf_modules`` are recorded as one call each and run as Python at every step.
The forward runs three times, at three batch sizes, and the three recordings must agree: integers that
differ grow linearly with the batch size and become `affine` nodes, anything else that differs is
refused. Python values taken from tensors (``bool(t)``, ``t.item()``) are refused when the tensor depends
on the batch, and otherwise become *guards*, checked at every call. Calls inside a reentrant activation
checkpoint are recorded as computed with gradients (`_in_reentrant_checkpoint`).
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointFunction

from lightning_deeppool.capture.trace import (
    BATCH_SIZE,
    CaptureError,
    GraphBreak,
    Leaf,
    ModuleCall,
    Trace,
    affine,
    graph_module,
    input_names,
)
from lightning_deeppool.capture.values import take_samples

SIZES = (2, 3, 5)
# The graph's name of the planned module's whole forward, recorded as one call (leaf module "").
WHOLE_FORWARD = "whole_forward"
# Calls that only read metadata: not recorded, their results are shapes and flags, not data.
_METADATA = {
    "size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous", "is_floating_point",
    "is_complex", "is_signed", "element_size", "storage_offset", "data_ptr", "get_device", "__len__",
    "__hash__", "__repr__", "__format__", "__str__", "untyped_storage", "has_names", "is_inference",
    "shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "grad_fn", "layout", "is_cuda",
    "is_cpu", "is_sparse", "is_quantized", "is_meta", "is_mkldnn", "is_nested", "names", "output_nr",
    "_version", "_base", "is_mps", "is_xpu", "itemsize", "nbytes", "_is_view", "is_conj", "is_neg",
}  # fmt: skip


class GuardError(RuntimeError):
    """A value the forward branched on at capture has changed; the captured graph no longer applies."""


def check_guard(value: Any, expected: Any, description: str) -> None:
    """Raise `GuardError` unless `value` equals what the forward saw at capture."""
    if value != expected:
        raise GuardError(
            f"the forward branched on {description}, which was {expected!r} at capture and is now "
            f"{value!r}: the captured graph no longer describes the model. Keep tensors that forward "
            "converts to Python values constant during training, or move that code into training_step"
        )


@dataclass(frozen=True)
class _Ref:
    """A tensor argument: produced by entry `entry` (leaf `leaf`), or an input / attribute / constant."""

    kind: str  # "entry", "input", "attr", "const"
    key: Any
    leaf: int = 0


@dataclass
class _Entry:
    fn: Any
    args: Any
    kwargs: dict[str, Any]
    out_spec: pytree.TreeSpec
    out_leaves: list[Any]
    stack: tuple[ModuleCall, ...]
    grad: bool
    module: str | None = None  # a leaf module's path: call it instead of fn
    guard: Any = None
    frame: tuple[str, int] | None = None  # the user's line that made the call


@dataclass
class _Tape:
    entries: list[_Entry] = field(default_factory=list)
    consts: list[torch.Tensor] = field(default_factory=list)
    outputs: Any = None
    out_spec: Any = None


def trace_by_recording(module: nn.Module, mapping: dict[str, Any], leaf_modules: Sequence[str] = ()) -> Trace:
    """Record ``module(**mapping)`` at three batch sizes and merge the recordings into a `Trace`."""
    named, input_spec = input_names(mapping)
    tapes = [_record(module, take_samples(mapping, size), named, leaf_modules) for size in SIZES]
    return _merge(module, tapes, named, input_spec)


class _Recorder(TorchFunctionMode):
    def __init__(self, tape: _Tape, refs: dict[int, _Ref], tainted: set[_Ref], stack: list[ModuleCall]):
        super().__init__()
        self.tape, self.refs, self.tainted, self.stack = tape, refs, tainted, stack
        self.alive: list[Any] = []  # keeps recorded tensors alive so their ids stay unique
        self.suppressed = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.suppressed:
            return func(*args, **kwargs)
        name = _name(func)
        if name in _METADATA:
            return func(*args, **kwargs)
        if name == "__iter__":
            # Iterating a tensor unbinds dimension 0: record the unbind, hand back an iterator over it.
            parts = torch.Tensor.unbind(*args)
            self.record(torch.Tensor.unbind, args, {}, parts)
            return iter(parts)
        if name == "__setitem__":
            func = _setitem
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        return None if func is _setitem else out

    def record(self, fn: Any, args: Any, kwargs: dict[str, Any], out: Any, module: str | None = None) -> None:
        tensor_args = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        template = pytree.tree_map(self.ref, (args, kwargs))
        tainted = any(self.refs.get(id(t)) in self.tainted for t in tensor_args)
        leaves, spec = pytree.tree_flatten(out)
        index = len(self.tape.entries)
        grad = torch.is_grad_enabled() or _in_reentrant_checkpoint()
        entry = _Entry(
            fn, template[0], template[1], spec, [], tuple(self.stack), grad, module, frame=_user_frame()
        )
        if not any(isinstance(leaf, torch.Tensor) for leaf in leaves) and module is None:
            if tainted:
                raise self.data_dependence(_name(fn), entry.frame)
            entry.guard = out
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                ref = _Ref("entry", index, i)
                self.refs[id(leaf)] = ref
                self.alive.append(leaf)
                if tainted:
                    self.tainted.add(ref)
            entry.out_leaves.append(leaf)
        self.tape.entries.append(entry)

    def whole(self, module: nn.Module, mapping: dict[str, Any]) -> Any:
        """Run `module`'s forward as one recorded call (leaf module ``""``)."""
        self.suppressed += 1
        try:
            out = type(module).forward(module, **mapping)
        finally:
            self.suppressed -= 1
        self.record(None, (), dict(mapping), out, module="")
        return out

    def data_dependence(self, call: str, frame: tuple[str, int] | None) -> GraphBreak:
        """The graph break of a Python value taken from batch data, at the user's line (`frame`)."""
        reason = f"converts a tensor computed from the batch to a Python value ({call}){_line(frame)}"
        return GraphBreak(reason, tuple(c.path for c in self.stack), reason)

    def ref(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        known = self.refs.get(id(value))
        if known is not None:
            return known
        if value.requires_grad or value.grad_fn is not None:
            raise CaptureError(
                f"forward reads a tensor that requires grad but is neither an argument nor a parameter "
                f"of the planned module{_user_line()}: deeppool cannot tell where it comes from. Register "
                "it as a parameter of the planned module, or compute it inside forward"
            )
        ref = _Ref("const", len(self.tape.consts))
        self.tape.consts.append(value)
        self.refs[id(value)] = ref
        return ref


def _setitem(tensor: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """``tensor[index] = value`` that returns the tensor, so later reads depend on the write."""
    tensor[index] = value
    return tensor


def _record(
    module: nn.Module, mapping: dict[str, Any], named: list[tuple[str, Any]], leaf_modules: Sequence[str]
) -> _Tape:
    tape = _Tape()
    refs: dict[int, _Ref] = {}
    for fqn, tensor in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        refs.setdefault(id(tensor), _Ref("attr", fqn))
    flat, _ = pytree.tree_flatten(mapping)
    tainted: set[_Ref] = set()
    for (name, _), leaf in zip(named, flat):
        if isinstance(leaf, torch.Tensor):
            refs[id(leaf)] = _Ref("input", name)
            tainted.add(refs[id(leaf)])
    stack: list[ModuleCall] = []
    recorder = _Recorder(tape, refs, tainted, stack)
    paths = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
    inner = [name for name in leaf_modules if name]
    with _module_calls(module, paths, stack, recorder, inner), recorder:
        out = (
            recorder.whole(module, mapping) if "" in leaf_modules else type(module).forward(module, **mapping)
        )
    tape.outputs, tape.out_spec = pytree.tree_flatten(out)
    tape.outputs = [recorder.ref(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in tape.outputs]
    return tape


@contextlib.contextmanager
def _module_calls(
    root: nn.Module,
    paths: dict[int, str],
    stack: list[ModuleCall],
    recorder: _Recorder,
    leaf_modules: Sequence[str],
) -> Iterator[None]:
    """Keep `stack` at the submodule calls being run; record leaf modules as one call each."""
    counts: dict[str, int] = {}

    def before(module: nn.Module, _: Any) -> None:
        path = paths.get(id(module))
        if path is None or module is root:
            return
        stack.append(ModuleCall(path, counts.get(path, 0)))
        counts[path] = counts.get(path, 0) + 1

    def after(module: nn.Module, _: Any, __: Any) -> None:
        if paths.get(id(module)) is not None and module is not root and stack:
            stack.pop()

    leaves = {name: root.get_submodule(name) for name in leaf_modules}
    for path, leaf in leaves.items():

        def call(
            *args: Any, _path: str = path, _forward: Callable[..., Any] = leaf.forward, **kwargs: Any
        ) -> Any:
            recorder.suppressed += 1
            try:
                out = _forward(*args, **kwargs)
            finally:
                recorder.suppressed -= 1
            recorder.record(None, args, kwargs, out, module=_path)
            return out

        leaf.forward = call  # type: ignore[method-assign]
    handles = [
        nn.modules.module.register_module_forward_pre_hook(before),
        nn.modules.module.register_module_forward_hook(after),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for leaf in leaves.values():
            del leaf.forward


def _merge(module: nn.Module, tapes: list[_Tape], named: list[tuple[str, Any]], input_spec: Any) -> Trace:
    """One `Trace` from the recordings at `SIZES`; raises `CaptureError` where they disagree."""
    _check_same_structure(tapes)
    builder = _GraphBuilder(module, tapes, named)
    for i in range(len(tapes[0].entries)):
        builder.add_call(i)
    builder.add_outputs()
    gm = builder.graph_module()
    inputs = builder.inputs
    return Trace(
        gm=gm,
        inputs=[node.name for node in inputs.values()],
        input_spec=input_spec,
        leaf_names=[inputs[name].name if name in inputs else None for name, _ in named],
        constants=[None if isinstance(leaf, torch.Tensor) else leaf for _, leaf in named],
        output_spec=tapes[0].out_spec,
        leaves=builder.leaves,
        stacks=builder.stacks,
        tracer="record",
        guards=tuple(builder.guards),
    )


class _GraphBuilder:
    """The graph of recordings of one forward at `SIZES`: a node per recorded call, its arguments
    merged across the recordings (an integer that grows with the batch size becomes an `affine` node,
    a tensor the node that made it). `leaves` and `stacks` describe each node, `guards` name the checks
    of the Python values the forward took from tensors."""

    def __init__(self, module: nn.Module, tapes: list[_Tape], named: list[tuple[str, Any]]) -> None:
        self.module, self.tapes, self.first = module, tapes, tapes[0]
        self.graph = fx.Graph()
        self.batch_node = self.graph.placeholder(BATCH_SIZE)
        self.inputs = {
            name: self.graph.placeholder(name) for name, leaf in named if isinstance(leaf, torch.Tensor)
        }
        self.leaves: dict[str, tuple[Leaf | None, ...]] = {
            self.inputs[name].name: (
                Leaf(leaf.dtype, (1, *leaf.shape[1:]), (0,)) if leaf.dim() else Leaf(leaf.dtype, (), ()),
            )
            for name, leaf in named
            if isinstance(leaf, torch.Tensor)
        }
        self.attrs: dict[str, Any] = {}
        self.attr_nodes: dict[str, fx.Node] = {}
        self.nodes: list[list[fx.Node]] = []  # per recorded call, the nodes of its output's leaves
        self.stacks: dict[str, tuple[ModuleCall, ...]] = {}
        self.guards: list[str] = []

    def add_call(self, i: int) -> None:
        """The nodes of recorded call `i`: the call, its output's leaves and the check of its guard.
        Raises `GraphBreak` where the recordings disagree in a way no graph can represent."""
        entry = self.first.entries[i]
        try:
            self._add_call(i, entry)
        except GraphBreak:
            raise
        except CaptureError as err:
            raise _graph_break(str(err), entry) from err

    def _add_call(self, i: int, entry: _Entry) -> None:
        position = f"call {i} ({_name(entry.fn) if entry.module is None else entry.module})"
        node = self._call_node(i, entry, position)
        outs = [_out_leaf(self.graph, node, j, entry) for j in range(len(entry.out_leaves))]
        self.nodes.append(outs)
        for j, out in enumerate(outs):
            values = [t.entries[i].out_leaves[j] for t in self.tapes]
            self.leaves[out.name] = (_leaf_info(values, position),)
            self.stacks[out.name] = entry.stack
        self.stacks[node.name] = entry.stack
        self.leaves.setdefault(
            node.name,
            tuple(
                _leaf_info([t.entries[i].out_leaves[j] for t in self.tapes], position)
                for j in range(len(entry.out_leaves))
            ),
        )
        if entry.guard is not None or (entry.module is None and not entry.out_leaves):
            check = self.graph.call_function(
                check_guard, (node, entry.guard, f"{_name(entry.fn)}{_line(entry.frame)}")
            )
            self.guards.append(check.name)
            self.stacks[check.name] = entry.stack

    def _call_node(self, i: int, entry: _Entry, position: str) -> fx.Node:
        """The node of recorded call `i` (a leaf module's call, else a function's)."""
        flat_args = [pytree.tree_flatten((t.entries[i].args, t.entries[i].kwargs))[0] for t in self.tapes]
        spec = pytree.tree_flatten((entry.args, entry.kwargs))[1]
        merged = [self._arg([f[j] for f in flat_args], position) for j in range(len(flat_args[0]))]
        args, kwargs = pytree.tree_unflatten(merged, spec)
        if entry.module is not None:
            node = self.graph.call_module(entry.module or WHOLE_FORWARD, tuple(args), kwargs)
        else:
            node = self.graph.call_function(entry.fn, tuple(args), kwargs)
        if not entry.grad:
            node.meta["no_grad"] = True
        return node

    def add_outputs(self) -> None:
        """The graph's output: the forward's returned leaves, merged like arguments."""
        count = len(self.first.outputs)
        self.graph.output(
            [self._arg([t.outputs[j] for t in self.tapes], f"output {j}") for j in range(count)]
        )

    def graph_module(self) -> fx.GraphModule:
        """The graph as a module holding the attributes it reads and the leaf modules it calls."""
        for node in self.graph.nodes:
            if node.op == "call_module":
                target = str(node.target)
                whole = target == WHOLE_FORWARD
                self.attrs[target] = (
                    _WholeForward(self.module) if whole else self.module.get_submodule(target)
                )
        buffers = {name for name, _ in self.module.named_buffers(remove_duplicate=False)}
        gm = graph_module(self.attrs, self.graph, buffers)
        for node in gm.graph.nodes:
            self.leaves.setdefault(node.name, ())
            self.stacks.setdefault(node.name, ())
        return gm

    def _arg(self, values: list[Any], position: str) -> Any:
        """One argument, from its value in each recording: a node, a literal or an `affine` node; raises
        `CaptureError` for a value that differs and is not an integer linear in the batch size."""
        value = values[0]
        if isinstance(value, _Ref):
            return self._node_of(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            if any(v != value for v in values[1:]):
                raise CaptureError(
                    f"the forward passes different values ({values}) to {position} at different batch sizes"
                )
            return value if _literal(value) else self._object_node(value)
        if all(v == value for v in values[1:]):
            return value
        scale, offset = _fit(values, position)
        return self.graph.call_function(affine, (self.batch_node, scale, offset))

    def _object_node(self, value: Any) -> fx.Node:
        """A constant the generated code cannot spell (an enum, a callable): held as an attribute."""
        name = f"_deeppool_object_{len(self.attrs)}"
        self.attrs[name] = value
        return self.graph.get_attr(name)

    def _node_of(self, ref: _Ref) -> fx.Node:
        """The node of a recorded tensor: a call's output, an input, or an attribute read once."""
        if ref.kind == "entry":
            return self.nodes[ref.key][ref.leaf]
        if ref.kind == "input":
            return self.inputs[ref.key]
        name = ref.key if ref.kind == "attr" else f"_deeppool_constant_{ref.key}"
        if name not in self.attr_nodes:
            self.attrs[name] = (
                _fetch(self.module, ref.key) if ref.kind == "attr" else self.first.consts[ref.key]
            )
            self.attr_nodes[name] = self.graph.get_attr(name)
        return self.attr_nodes[name]


class _WholeForward(nn.Module):
    """The planned module's own forward as a module the graph calls (its class's forward: the module's
    call may be the strategy's)."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self.root = root

    def forward(self, **kwargs: Any) -> Any:
        return type(self.root).forward(self.root, **kwargs)


def _graph_break(message: str, entry: _Entry) -> GraphBreak:
    """`message` as the graph break of recorded call `entry`, at its line of code."""
    reason = f"{message}{_line(entry.frame)}"
    return GraphBreak(reason, tuple(call.path for call in entry.stack), reason)


def _out_leaf(graph: fx.Graph, node: fx.Node, index: int, entry: _Entry) -> fx.Node:
    """The node of one leaf of a call's output: the call itself when its output is one tensor."""
    if entry.out_spec.num_leaves == 1 and entry.out_spec.is_leaf():
        return node
    getter = graph.call_function(_leaf_of, (node, index))
    if "no_grad" in node.meta:
        getter.meta["no_grad"] = True
    return getter


def _leaf_of(value: Any, index: int) -> Any:
    """Leaf `index` of a pytree `value`."""
    return pytree.tree_leaves(value)[index]


_LITERALS = (
    int,
    float,
    bool,
    str,
    type(None),
    type(Ellipsis),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


def _literal(value: Any) -> bool:
    """Whether generated code can spell `value` (fx writes constants into Python source)."""
    if isinstance(value, slice):
        return all(_literal(v) for v in (value.start, value.stop, value.step))
    if isinstance(value, tuple | list):
        return all(_literal(v) for v in value)
    return isinstance(value, _LITERALS)


def _fetch(module: nn.Module, fqn: str) -> Any:
    value: Any = module
    for atom in fqn.split("."):
        value = getattr(value, atom)
    return value


def _fit(values: list[Any], position: str) -> tuple[int, int]:
    """Integer scale and offset with ``value == scale * size + offset`` at every recorded size."""
    if any(isinstance(v, float) for v in values):
        raise CaptureError(
            f"the forward passes a number computed from the batch size to {position} "
            f"({values} at batch sizes {list(SIZES)}); "
            "deeppool can only rescale integers that grow linearly with the batch"
        )
    (s0, s1), (v0, v1) = SIZES[:2], values[:2]
    scale, rest = divmod(v1 - v0, s1 - s0)
    offset = v0 - scale * s0
    if rest or any(v != scale * s + offset for s, v in zip(SIZES, values)):
        raise CaptureError(
            f"the forward passes {values} to {position} at batch sizes {list(SIZES)}: "
            "not a linear function of the batch size, so deeppool cannot rescale it for a shard of the batch"
        )
    return scale, offset


def _leaf_info(values: list[Any], position: str) -> Leaf | None:
    first = values[0]
    if not isinstance(first, torch.Tensor):
        return None
    shape, batch_dims, rows = [], [], 1
    for dim, size in enumerate(first.shape):
        sizes = [v.shape[dim] for v in values]
        if all(s == size for s in sizes):
            shape.append(int(size))
            continue
        scale, offset = _fit(sizes, f"the shape of {position}")
        if offset or scale < 1:
            raise CaptureError(f"{position} has a dimension of sizes {sizes} at batch sizes {list(SIZES)}")
        batch_dims.append(dim)
        rows = scale
        shape.append(scale)
    return Leaf(first.dtype, tuple(shape), tuple(batch_dims), rows)


def _check_same_structure(tapes: list[_Tape]) -> None:
    """Raise `GraphBreak` at the first call where a recording's control flow differs from the first's."""
    first = tapes[0]
    for size, tape in zip(SIZES[1:], tapes[1:]):
        for i, (a, b) in enumerate(zip(first.entries, tape.entries)):
            if a.fn is not b.fn or a.module != b.module or a.guard != b.guard:
                raise _graph_break(
                    f"the forward's call {i} is {_name(a.fn)} at batch size {SIZES[0]} and {_name(b.fn)} at "
                    f"{size}: its control flow depends on the batch size",
                    a,
                )
        if len(tape.entries) != len(first.entries):
            count = min(len(tape.entries), len(first.entries))
            longer = max(tape.entries, first.entries, key=len)
            raise _graph_break(
                f"the forward made {len(first.entries)} torch calls at batch size {SIZES[0]} and "
                f"{len(tape.entries)} at batch size {size}: its control flow depends on the batch size",
                longer[count],
            )


def _name(fn: Any) -> str:
    if fn is None:
        return "module"
    name = getattr(fn, "__name__", None)
    owner = getattr(fn, "__self__", None)
    if name == "__get__" and owner is not None:
        return getattr(owner, "__name__", "__get__")
    return name or str(fn)


def _in_reentrant_checkpoint() -> bool:
    """Whether the call runs inside a reentrant activation checkpoint's forward (``checkpoint(...,
    use_reentrant=True)``) that computes gradients: it turns them off and, when a tensor it was given
    requires grad, computes them in its backward by running the function again. Recorded as computed
    with gradients, such a call trains as on one device (without the checkpoint's memory saving)."""
    code = CheckpointFunction.forward.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            inputs = frame.f_locals.get("args", ())
            return any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
        frame = frame.f_back  # type: ignore[assignment]
    return False


_OURS = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))


def _user_frame() -> tuple[str, int] | None:
    """File and line of the innermost frame outside torch and this package (cheap: no source read)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_OURS) and "contextlib" not in filename:
            return filename, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _line(frame: tuple[str, int] | None) -> str:
    """`` at file:line: code`` of a `_user_frame`, or nothing."""
    if frame is None:
        return ""
    code = linecache.getline(*frame).strip()
    return f" at {frame[0]}:{frame[1]}: {code}"


def _user_line() -> str:
    """`file:line: code` of the innermost frame outside torch and this package."""
    return _line(_user_frame())
