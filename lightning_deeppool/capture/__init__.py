"""Capture: the planned module's forward as a graph of layers, shared by the planner and the runtime.

`capture_graph` runs the forward once as it is, then captures it with `torch.export` (symbolic batch
size; Hugging Face models take their export-friendly paths), falling back to recording the torch calls
of real runs (`record`) where export fails or `leaf_modules` are given. The trace is cut into layers
(`layers`) and checked (`check`): replayed layer by layer it must reproduce forward, and no layer may
mix samples. Code neither tracer can represent (a `GraphBreak`: sizes or Python values taken from the
batch's data) makes the smallest submodule call around it a leaf module run at full width on each
rank's own samples (`Break`), or, in the planned module's own forward, the whole forward one such
call. Anything else that cannot be proven is refused with a `CaptureError` that says what to do.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.nn.utils import parametrize
from torch.utils import _pytree as pytree

from lightning_deeppool.capture.check import check_per_sample, check_replay
from lightning_deeppool.capture.codegen import Compiler
from lightning_deeppool.capture.export import trace_with_export
from lightning_deeppool.capture.graph import (
    CallSignature,
    CapturedGraph,
    call_mapping,
    evaluate,
    preserved,
)
from lightning_deeppool.capture.layers import cut_into_layers
from lightning_deeppool.capture.outputs import register_containers
from lightning_deeppool.capture.record import GuardError, trace_by_recording
from lightning_deeppool.capture.state import record_state, watch_strings
from lightning_deeppool.capture.trace import Break, CaptureError, GraphBreak, Trace
from lightning_deeppool.capture.values import LeafMeta, ValueMeta, take_samples
from lightning_deeppool.ir.graph import under

__all__ = [
    "Break",
    "CaptureError",
    "CapturedGraph",
    "GuardError",
    "LeafMeta",
    "ValueMeta",
    "capture_graph",
    "evaluate",
    "widest",
]


def capture_graph(
    module: nn.Module,
    example_args: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    leaf_modules: Sequence[str] = (),
    granularity: str = "layer",
    compiler: Compiler | None = None,
    breaks: Sequence[Break] = (),
) -> CapturedGraph:
    """Capture ``type(module).forward`` on an example batch and cut it into layers.

    Tensor arguments are batches (dimension 0 is the sample); other arguments are constants of the
    capture. `granularity` is ``"layer"`` (operations without parameters join the layer they follow)
    or ``"module"`` (a layer per submodule call). The layers run through `compiler` (the module was
    compiled as a whole), or the compiler of the submodule they belong to where `torch.compile` wrapped
    one. Modules with parametrizations (`torch.nn.utils.parametrize`: spectral or weight norm) are
    leaf modules too: their weight is computed when read, which export does not trace. Graph breaks
    become leaf modules as the module docstring says (`CapturedGraph.breaks`), starting from `breaks`
    (another capture's, or every rank's: see `widest`). Raises `CaptureError` naming the construct that
    failed and what to do.
    """
    leaf_modules = _with_parametrized(module, leaf_modules)
    # Captured without autocast, the graph holds no precision casts: under mixed precision each
    # operation is cast when it runs, as in eager.
    device_type = next((p.device.type for p in module.parameters()), "cpu")
    found = {b.path: b for b in breaks}
    while True:
        leaves = (*(name for name in leaf_modules if not _inside(name, found)), *found)
        try:
            with torch.autocast(device_type, enabled=False):
                captured = _capture(
                    module, example_args, example_kwargs or {}, leaves, granularity, tuple(found.values())
                )
            break
        except GraphBreak as err:
            found = _with_break(module, found, leaves, err)
    return dataclasses.replace(captured, compilers=_compilers(module, compiler))


def widest(breaks: Iterable[Break]) -> tuple[Break, ...]:
    """Graph breaks found by several captures (each rank's, on its own data) together, less those
    inside another, in path order: where every capture starts from them, all make the same graph."""
    every = {b.path: b for b in breaks}
    return tuple(every[p] for p in sorted(every) if not any(o != p and under(p, o) for o in every))


def _inside(path: str, breaks: Mapping[str, Break]) -> bool:
    return any(under(path, outer) for outer in breaks)


def _with_break(
    module: nn.Module, breaks: dict[str, Break], leaves: Sequence[str], err: GraphBreak
) -> dict[str, Break]:
    """`breaks` with the smallest submodule call around `err` that is not a leaf yet (the whole forward,
    ``""``, where there is none), keeping the reason of a break it replaces. Raises `CaptureError` where
    even the whole forward, as one call, cannot be captured."""
    path = next((p for p in reversed(err.stack) if p not in leaves), "")
    if path in leaves:  # "" already: the whole forward as one call
        first = next(iter(breaks.values()))
        raise CaptureError(
            f"{type(module).__name__}.forward cannot be captured: {first.reason}; run as one call at full "
            f"width it still cannot be: {err}. Move that code into training_step, or point the planner at "
            "the part that can be captured with DeepPoolStrategy(module='<submodule name>')"
        ) from err
    replaced = [b for p, b in breaks.items() if under(p, path)]
    reason = replaced[0].reason if replaced else err.reason
    kind = type(module.get_submodule(path)).__name__
    outer = tuple(err.stack[: err.stack.index(path)]) if path in err.stack else ()
    kept = {p: b for p, b in breaks.items() if not under(p, path)}
    return {**kept, path: Break(path, kind, reason, outer)}


def _with_parametrized(module: nn.Module, leaf_modules: Sequence[str]) -> tuple[str, ...]:
    """`leaf_modules` and the outermost parametrized modules not inside one of them."""
    found = list(leaf_modules)
    for path, submodule in module.named_modules():
        inside = any(path == leaf or path.startswith(f"{leaf}.") for leaf in found)
        if path and not inside and parametrize.is_parametrized(submodule):
            found.append(path)
    return tuple(found)


def _compilers(module: nn.Module, compiler: Compiler | None) -> tuple[tuple[str, Compiler], ...]:
    """By module path: `compiler` for the whole module, each compiled submodule's for its layers
    (captured under its ``_orig_mod``)."""
    compiled = [
        (f"{path}._orig_mod" if path else "_orig_mod", submodule.dynamo_ctx)
        for path, submodule in module.named_modules()
        if isinstance(submodule, OptimizedModule)
    ]
    return ((("", compiler),) if compiler is not None else ()) + tuple(compiled)


def _capture(
    module: nn.Module,
    example_args: Sequence[Any],
    example_kwargs: Mapping[str, Any],
    leaf_modules: Sequence[str],
    granularity: str,
    breaks: tuple[Break, ...] = (),
) -> CapturedGraph:
    signature = inspect.signature(type(module).forward.__get__(module))
    mapping = _distinct(call_mapping(signature, example_args, example_kwargs))
    _check_arguments(module, mapping)
    _check_sparse_gradients(module)
    if _samples(mapping) == 1:  # export specializes a dimension of size 1: show it two samples
        mapping = take_samples(mapping, 2)
    leaves, spec = pytree.tree_flatten(mapping)
    watched, touched = watch_strings(leaves)  # a string forward never uses does not pick the graph
    strings = any(isinstance(leaf, str) for leaf in leaves)
    run_on = pytree.tree_unflatten(watched, spec) if strings else mapping
    try:
        with torch.enable_grad(), preserved(module), record_state(module) as recorded:
            outputs = type(module).forward(module, **run_on)
    except Exception as err:
        raise CaptureError(
            f"running {type(module).__name__}.forward on the example batch failed: {err}"
        ) from err
    state = recorded[0]
    register_containers(outputs)
    _check_outputs(module, outputs)
    trace = _trace(module, mapping, leaf_modules)
    trace, hooked = _with_hooked_outputs(trace, state.hooks)
    call = CallSignature(
        signature=signature,
        spec=trace.input_spec,
        constants=tuple(trace.constants),
        names=tuple(trace.leaf_names),
        unread=frozenset(i for i, leaf in enumerate(leaves) if isinstance(leaf, str) and i not in touched),
    )
    paths = [b.path for b in breaks]
    captured = _with_input_grads(cut_into_layers(trace, call, granularity, paths), call, mapping)
    captured = dataclasses.replace(captured, state=state, hooked=hooked, breaks=breaks)
    check_replay(captured, module, mapping)
    check_per_sample(captured, module, mapping)
    return captured


def _with_hooked_outputs(trace: Trace, hooks: Sequence[tuple[str, str]]) -> tuple[Trace, tuple[str, ...]]:
    """`trace` returning, after forward's own outputs, the output of each submodule a forward hook is
    registered on (the runtime hands it to the hooks: the graph runs no module's call), and those
    submodules' paths. Raises `CaptureError` for a global hook, or a hooked submodule called more than
    once or returning more than one tensor."""
    paths = sorted({path for path, _ in hooks if path})
    if "<global>" in paths:
        raise CaptureError(
            "a global forward hook (nn.modules.module.register_module_forward_hook) is registered: the "
            "plan runs the captured graph, not the modules' calls, so it would not run for the planned "
            "modules. Remove it before training, or register it on the modules whose outputs it needs"
        )
    if not paths:
        return trace, ()
    output = next(n for n in trace.gm.graph.nodes if n.op == "output")
    returned = list(output.args[0])
    kept = [_output_of(trace, path) for path in paths]
    output.args = ([*returned, *kept],)
    trace.gm.recompile()
    spec = pytree.tree_structure((pytree.tree_unflatten(returned, trace.output_spec), tuple(kept)))
    return dataclasses.replace(trace, output_spec=spec), tuple(paths)


def _output_of(trace: Trace, path: str) -> Any:
    """The node holding the output of submodule `path`'s call."""
    inside = [n for n in trace.gm.graph.nodes if any(c.path == path for c in trace.stacks.get(n.name, ()))]
    calls = {c.occurrence for n in inside for c in trace.stacks[n.name] if c.path == path}
    names = {n.name for n in inside}
    found = [n for n in inside if any(user.name not in names for user in n.users)]
    if len(calls) != 1 or len(found) != 1:
        raise CaptureError(
            f"a forward hook is registered on {path!r}, which forward calls {len(calls)} times, returning "
            f"{len(found)} values: deeppool hands a hook the output of a submodule called once that returns "
            "one tensor. Register the hook on such a submodule, or compute the value in forward"
        )
    return found[0]


def _with_input_grads(captured: CapturedGraph, call: CallSignature, mapping: dict[str, Any]) -> CapturedGraph:
    """`captured` with its graph inputs marked where the example batch's tensor requires grad."""
    leaves = pytree.tree_leaves(mapping)
    grads = {name for name, leaf in zip(call.names, leaves) if getattr(leaf, "requires_grad", False)}
    inputs = tuple(dataclasses.replace(i, requires_grad=i.name in grads) for i in captured.graph.inputs)
    return dataclasses.replace(captured, graph=dataclasses.replace(captured.graph, inputs=inputs))


def _trace(module: nn.Module, mapping: dict[str, Any], leaf_modules: Sequence[str]) -> Trace:
    if leaf_modules:
        return _record(module, mapping, leaf_modules, None)
    try:
        with torch.enable_grad(), preserved(module):
            return trace_with_export(module, mapping)
    except CaptureError:
        raise
    except Exception as err:  # export's many failure types: fall back to recording
        return _record(module, mapping, leaf_modules, err)


def _record(
    module: nn.Module, mapping: dict[str, Any], leaf_modules: Sequence[str], export_error: Exception | None
) -> Trace:
    for name in filter(None, leaf_modules):
        try:
            module.get_submodule(name)
        except AttributeError:
            raise CaptureError(
                f"leaf_modules names {name!r}, which is not a submodule of the planned module"
            ) from None
    try:
        with torch.enable_grad(), preserved(module):
            return trace_by_recording(module, mapping, leaf_modules)
    except CaptureError as err:
        if export_error is None or isinstance(err, GraphBreak):
            raise
        first = (
            str(export_error).strip().splitlines()[0]
            if str(export_error).strip()
            else type(export_error).__name__
        )
        raise CaptureError(
            f"{err}\n(torch.export failed first: {type(export_error).__name__}: {first})"
        ) from err


def _distinct(mapping: dict[str, Any]) -> dict[str, Any]:
    """The arguments with every tensor passed twice (``labels=input_ids``) copied: the capture must not
    assume two arguments are one tensor, since a later call may pass different ones."""
    seen: set[int] = set()

    def copy(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if id(leaf) in seen:
            return leaf.clone()
        seen.add(id(leaf))
        return leaf

    return pytree.tree_map(copy, mapping)


def _check_arguments(module: nn.Module, mapping: dict[str, Any]) -> None:
    leaves = [
        leaf for leaf in pytree.tree_leaves(mapping) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
    ]
    if not leaves:
        raise CaptureError(
            f"{type(module).__name__}.forward receives no tensor with a batch dimension; deeppool splits the "
            "tensor arguments of forward by their first dimension"
        )
    sizes = {leaf.shape[0] for leaf in leaves}
    if len(sizes) > 1:
        raise CaptureError(
            f"the tensor arguments of {type(module).__name__}.forward disagree on the number of samples "
            f"({sorted(sizes)}): deeppool treats dimension 0 of every tensor argument as the batch"
        )


def _samples(mapping: dict[str, Any]) -> int:
    return next(
        leaf.shape[0] for leaf in pytree.tree_leaves(mapping) if isinstance(leaf, torch.Tensor) and leaf.dim()
    )


def _check_sparse_gradients(module: nn.Module) -> None:
    sparse = [path for path, m in module.named_modules() if getattr(m, "sparse", False) is True]
    if sparse:
        raise CaptureError(
            f"{sparse[:3]} produce sparse gradients (nn.Embedding(sparse=True)), which deeppool's gradient "
            "buckets, flat dense tensors, cannot hold. Use sparse=False (plain SGD then makes the same "
            "update), or train this model with strategy='ddp'"
        )


def _check_outputs(module: nn.Module, outputs: Any) -> None:
    for path, leaf in pytree.tree_flatten_with_path(outputs)[0]:
        if isinstance(leaf, torch.Tensor) or leaf is None or isinstance(leaf, int | float | bool | str):
            continue
        hint = (
            " For Hugging Face models, turn the cache off for training: model.config.use_cache = False."
            if type(leaf).__name__.endswith("Cache")
            else ""
        )
        raise CaptureError(
            f"{type(module).__name__}.forward returns a {type(leaf).__name__} at "
            f"{pytree.keystr(path) or 'the top'}, "
            "which deeppool cannot split by sample; return tensors (or tuples, lists, dicts and "
            f"dataclasses of them).{hint}"
        )
