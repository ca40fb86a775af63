"""Cut a `Trace` into layers: the units the planner gives widths to.

Nodes that depend on the batch's data are grouped by the innermost submodule call that ran them (nodes
of the forward itself, outside any submodule, are a layer each), in execution order. Values that cross
from one layer to the next must carry the batch first (or be a per-rank reduction read only at full
width); layers that exchange anything else, such as a sequence-first tensor, are merged. At the default
granularity, ``"layer"``, groups without parameters (an activation, dropout, a residual add, pooling, a
reshape) join the group whose value they read just before them: a width change around them would only
cost a redistribution. They never make a group that splits by height unsplittable: the pooling and
flatten of a CNN's head join the head instead. At ``"module"`` every submodule call stays a layer.
Auxiliary nodes (independent of the data) are evaluated by each layer that needs them; in-place updates
of buffers run once, in the layer of the submodule that makes them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from lightning_deeppool.capture.graph import CallSignature, CapturedGraph, LayerCode, fetch_attr
from lightning_deeppool.capture.record import WHOLE_FORWARD
from lightning_deeppool.capture.split_rules import split_shape
from lightning_deeppool.capture.trace import CaptureError, Leaf, Trace, describe, where
from lightning_deeppool.capture.values import LeafMeta, ValueMeta
from lightning_deeppool.ir.graph import GraphInput, Layer, LayerGraph, Tied

# Operations whose results the first-step check cannot compare with one device's.
_BATCH_STATISTICS = {
    "batch_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional",
}
_RANDOM = {
    "dropout", "bernoulli", "bernoulli_", "rand", "randn", "rand_like", "randn_like", "randint", "randperm",
    "native_dropout", "feature_dropout", "alpha_dropout", "dropout1d", "dropout2d", "dropout3d",
    "multinomial", "normal", "uniform_", "normal_", "scaled_dot_product_attention",
}  # fmt: skip


GRANULARITIES = ("layer", "module")


def cut_into_layers(
    trace: Trace, call: CallSignature, granularity: str = "layer", breaks: Collection[str] = ()
) -> CapturedGraph:
    """The layers of a trace; raises `CaptureError` for values that cannot be split by sample. The layers
    of the leaf module calls `breaks` (paths; ``""`` the whole forward) are `Layer.own_samples`."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    classified = _classify(trace)
    uses = _ParameterUse(trace.gm)
    units = _layer_units(trace, classified, uses, granularity, breaks)
    names = _unit_names(units, set(trace.inputs), uses)
    layers = _LayerBuilder(trace, classified, uses, units, names, breaks)
    for name, unit in zip(names, units):
        layers.add(name, unit)
    returned = _returned(trace.gm.graph)
    graph = _layer_graph(classified, layers, returned)
    return _captured(trace, call, classified, layers, graph, returned)


@dataclass(frozen=True)
class _Classified:
    """What the trace's nodes depend on. `nodes` are its computing nodes (neither placeholders nor the
    output) in graph order; `tainted` those that depend on the batch's data, with the batch inputs;
    `kinds` each node's `_kind`, ``"aux"`` for the rest, ``"batch"`` for the batch inputs."""

    nodes: list[fx.Node]
    batch_inputs: list[str]
    scalar_inputs: list[str]
    tainted: set[str]
    kinds: dict[str, str]


def _classify(trace: Trace) -> _Classified:
    """The trace's nodes by what they depend on, dead code dropped; raises `CaptureError` where a
    per-sample value reads a reduction over the batch."""
    graph = trace.gm.graph
    _drop_dead_code(graph)
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    batch_inputs = [name for name in trace.inputs if _has_batch(trace.leaves[name])]
    scalar_inputs = [n for n in trace.inputs if n not in batch_inputs]
    tainted = _tainted(graph, batch_inputs)
    kinds = {n.name: _kind(trace.leaves[n.name]) if n.name in tainted else "aux" for n in nodes}
    for name in batch_inputs:
        kinds[name] = "batch"
    _check_flows(graph, kinds)
    return _Classified(nodes, batch_inputs, scalar_inputs, tainted, kinds)


def _layer_units(
    trace: Trace, classified: _Classified, uses: _ParameterUse, granularity: str, breaks: Collection[str]
) -> list[list[fx.Node]]:
    """The data-dependent nodes grouped into layers, in execution order (see the module docstring)."""
    units = _units(trace, [n for n in classified.nodes if n.name in classified.tainted])
    units = _merge_units(units, classified.kinds, trace.gm.graph)
    if granularity == "layer":
        units = _join_cheap_units(units, trace, classified.kinds, uses, breaks)
    return units


class _LayerBuilder:
    """Each unit's layer, added in execution order: its code, the description of its value (`meta`,
    which starts with the batch inputs') and its `Layer`, which counts a parameter at its first user."""

    def __init__(
        self,
        trace: Trace,
        classified: _Classified,
        uses: _ParameterUse,
        units: list[list[fx.Node]],
        names: list[str],
        breaks: Collection[str] = (),
    ) -> None:
        self.trace, self.classified, self.uses, self.breaks = trace, classified, uses, breaks
        self.owner = {node.name: name for name, unit in zip(names, units) for node in unit}
        self.effects = _effects(trace, classified.nodes, classified.tainted, units, names)
        self.order = {n: i for i, n in enumerate(trace.gm.graph.nodes)}
        self.params = dict(trace.gm.named_parameters())
        self.counted: set[str] = set()
        self.code: dict[str, LayerCode] = {}
        self.layers: list[Layer] = []
        self.meta = {name: _input_meta(trace.leaves[name][0]) for name in classified.batch_inputs}
        self.layer_params: dict[str, list[str]] = {}

    def add(self, name: str, unit: list[fx.Node]) -> None:
        """Add the layer `name`, made of `unit`."""
        code = self.code[name] = self._code(name, unit)
        used = self.layer_params[name] = self.uses.of(code.nodes)
        fresh = [p for p in used if p not in self.counted]
        self.counted.update(fresh)
        per_rank = any(self.classified.kinds[n.name] == "per_rank" for n in unit)
        self.meta[name] = _layer_meta(self.trace, code.outputs, per_rank)
        broken = _broken(unit, self.breaks)
        height, halo_bytes = (0, 0) if per_rank or broken is not None else split_shape(self.trace, code)
        first = self.uses.first_user(unit)
        module = first.meta.get("deeppool_unit") if broken is None else broken
        self.layers.append(
            Layer(
                name=name,
                op="call_module" if module is not None else "call_function",
                target=module if module is not None else describe(first).split(" ", 1)[1],
                inputs=tuple(producer for producer, _ in code.reads),
                sample_bytes=self.meta[name].sample_bytes,
                params=sum(self.params[p].numel() for p in fresh),
                param_bytes=sum(self.params[p].numel() * self.params[p].element_size() for p in fresh),
                per_rank=per_rank,
                height=height,
                halo_bytes=halo_bytes,
                own_samples=broken is not None,
            )
        )

    def _code(self, name: str, unit: list[fx.Node]) -> LayerCode:
        """The unit's nodes with the state updates it runs and the auxiliary nodes it reads; the nodes
        other layers or the output read; and what it reads from each layer or input."""
        own = [*unit, *self.effects.get(name, [])]
        own_set, owner = set(own), self.owner
        outputs = [
            n.name for n in unit
            if any(user not in own_set and (user.op == "output" or user.name in owner) for user in n.users)
        ]  # fmt: skip
        reads: dict[str, dict[str, None]] = {}
        for n in own:
            for source in n.all_input_nodes:
                if source in own_set or self.classified.kinds.get(source.name, "aux") == "aux":
                    continue
                producer = owner.get(source.name, source.name)
                reads.setdefault(producer, {})[source.name] = None
        closure = _closure(own, self.classified.tainted)
        evaluated = tuple(sorted({*closure, *own}, key=self.order.__getitem__))
        return LayerCode(evaluated, tuple(outputs), tuple((k, tuple(v)) for k, v in reads.items()))


def _broken(unit: Sequence[fx.Node], breaks: Collection[str]) -> str | None:
    """The graph break (a path in `breaks`) whose leaf module call `unit` holds, if any."""
    for node in unit:
        if node.op == "call_module":
            path = "" if node.target == WHOLE_FORWARD else node.meta.get("deeppool_unit")
            if path in breaks:
                return str(path)
    return None


def _returned(graph: fx.Graph) -> list[Any]:
    """What forward returns, flattened: nodes and constants."""
    return list(next(n for n in graph.nodes if n.op == "output").args[0])


def _check_returned(returned: list[Any], kinds: dict[str, str]) -> None:
    """Raise `CaptureError` for a returned value that is not batch-first."""
    for leaf in returned:
        if isinstance(leaf, fx.Node) and kinds.get(leaf.name) == "internal":
            raise CaptureError(
                f"forward returns {leaf.name!r} ({describe(leaf)}){where(leaf)}, whose batch dimension "
                "is not dimension 0 (or which mixes batch and other values); deeppool returns outputs to "
                "the ranks holding their samples, so return tensors with the batch dimension first"
            )


def _layer_graph(classified: _Classified, layers: _LayerBuilder, returned: list[Any]) -> LayerGraph:
    """The planner's view: the batch inputs, the layers, the inputs and layers whose values forward
    returns, and the parameters more than one layer uses; raises `CaptureError` for a returned value
    that is not batch-first."""
    _check_returned(returned, classified.kinds)
    sources = {
        layers.owner.get(leaf.name, leaf.name)
        for leaf in returned
        if isinstance(leaf, fx.Node) and classified.kinds.get(leaf.name, "aux") != "aux"
    }
    users: dict[str, list[str]] = {}
    for name, used in layers.layer_params.items():
        for param in used:
            users.setdefault(param, []).append(name)
    params = layers.params
    return LayerGraph(
        inputs=tuple(GraphInput(name, layers.meta[name].sample_bytes) for name in classified.batch_inputs),
        layers=tuple(layers.layers),
        outputs=tuple(s for s in [*classified.batch_inputs, *layers.code] if s in sources),
        tied=tuple(
            Tied(param, params[param].numel() * params[param].element_size(), tuple(by))
            for param, by in users.items()
            if len(by) > 1
        ),
    )


def _captured(
    trace: Trace,
    call: CallSignature,
    classified: _Classified,
    layers: _LayerBuilder,
    graph: LayerGraph,
    returned: list[Any],
) -> CapturedGraph:
    """The `CapturedGraph` of the layers, with the guards and the nodes they read, in graph order."""
    guards = _closure([trace.node(g) for g in trace.guards], classified.tainted)
    targets = {_target_name(n) for n in classified.nodes}
    return CapturedGraph(
        module=trace.gm,
        graph=graph,
        code=layers.code,
        layer_params=layers.layer_params,
        batch_inputs=classified.batch_inputs,
        scalar_inputs=classified.scalar_inputs,
        meta=layers.meta,
        call=call,
        outputs=returned,
        output_spec=trace.output_spec,
        tracer=trace.tracer,
        stochastic=bool(targets & _RANDOM),
        batch_statistics=bool(targets & _BATCH_STATISTICS),
        guards=tuple(sorted({*guards, *(trace.node(g) for g in trace.guards)}, key=layers.order.__getitem__)),
    )


def _has_batch(leaves: tuple[Leaf | None, ...]) -> bool:
    return bool(leaves) and leaves[0] is not None and bool(leaves[0].batch_dims)


def _tainted(graph: fx.Graph, batch_inputs: Sequence[str]) -> set[str]:
    """Nodes whose value depends on the batch's data (not only on its size)."""
    tainted = set(batch_inputs)
    for node in graph.nodes:
        if node.op not in ("placeholder", "output") and any(i.name in tainted for i in node.all_input_nodes):
            tainted.add(node.name)
    return tainted


def _kind(leaves: tuple[Leaf | None, ...]) -> str:
    """'batch' (every leaf a batch-first tensor), 'per_rank' (tensors without a batch dimension: a
    reduction over the rank's samples) or 'internal' (anything else: must stay inside one layer)."""
    if not leaves or any(leaf is None for leaf in leaves):
        return "internal"
    dims = {leaf.batch_dims for leaf in leaves if leaf is not None}
    if dims == {(0,)}:
        return "batch"
    if dims == {()}:
        return "per_rank"
    return "internal"


def _check_flows(graph: fx.Graph, kinds: dict[str, str]) -> None:
    for node in graph.nodes:
        if kinds.get(node.name) != "batch" or node.op == "placeholder":
            continue
        for source in node.all_input_nodes:
            if kinds.get(source.name) == "per_rank":
                raise CaptureError(
                    f"node {node.name!r} ({describe(node)}){where(node)} combines per-sample values with "
                    f"{source.name!r}, a reduction over the batch: it mixes samples, which deeppool cannot "
                    "split across devices. Compute batch statistics in training_step instead"
                )


def _units(trace: Trace, tainted: list[fx.Node]) -> list[list[fx.Node]]:
    """Maximal runs of data-dependent nodes in the same innermost submodule call."""
    units: list[list[fx.Node]] = []
    last: Any = None
    for node in tainted:
        stack = trace.stacks.get(node.name, ())
        key = stack[-1] if stack else ("node", node.name)
        node.meta["deeppool_unit"] = stack[-1].path if stack else None
        if units and key == last:
            units[-1].append(node)
        else:
            units.append([node])
        last = key
    return units


def _merge_units(units: list[list[fx.Node]], kinds: dict[str, str], graph: fx.Graph) -> list[list[fx.Node]]:
    """Merge the units between a producer and its consumers where the value between them cannot cross."""
    index = {node.name: i for i, unit in enumerate(units) for node in unit}
    spans = []
    for i, unit in enumerate(units):
        for node in unit:
            consumers = [index[u.name] for u in node.users if u.name in index]
            crossing = consumers and max(consumers) > i
            if not crossing:
                continue
            users_kinds = {kinds[u.name] for u in node.users if u.name in index}
            blocked = kinds[node.name] == "internal" or (
                kinds[node.name] == "per_rank" and users_kinds - {"per_rank"}
            )
            if blocked:
                spans.append((i, max(consumers)))
    if not spans:
        return units
    merged: list[list[fx.Node]] = []
    spans.sort()
    cover: dict[int, int] = {}
    for lo, hi in spans:
        for j in range(lo, hi + 1):
            cover[j] = max(cover.get(j, j), hi)
    i = 0
    while i < len(units):
        end = i
        while end in cover and cover[end] > end:
            end = cover[end]
        group = [node for unit in units[i : end + 1] for node in unit]
        merged.append(group)
        i = end + 1
    return merged


def _join_cheap_units(
    units: list[list[fx.Node]],
    trace: Trace,
    kinds: dict[str, str],
    uses: _ParameterUse,
    breaks: Collection[str] = (),
) -> list[list[fx.Node]]:
    """Units without parameters join the unit just before them when they read it, or, before any unit
    with parameters, the unit just after them when it reads them. Per-rank units join only each other;
    a graph break's unit (a call of a path in `breaks`) joins none, so it holds its own code alone.
    A join never makes a unit that splits by height unsplittable: such a unit (the head's pooling after
    the last convolution) stays apart and the next unit joins it, where that next unit cannot split
    either."""

    def _joinable(before: list[fx.Node], after: list[fx.Node], kinds: dict[str, str]) -> bool:
        broken = _broken(before, breaks) is not None or _broken(after, breaks) is not None
        return not broken and _reads_alike(before, after, kinds)

    joined: list[list[fx.Node]] = []
    splits: list[bool] = []  # per joined unit: whether it splits by height
    apart: set[int] = set()  # joined units kept apart to keep the one before them splittable
    for unit in units:
        previous = joined[-1] if joined else None
        if previous is not None and not uses.in_unit(unit) and _joinable(previous, unit, kinds):
            if not splits[-1] or _splits(trace, [*previous, *unit], kinds):
                previous.extend(unit)
                continue
            apart.add(len(joined))
        elif (
            previous is not None
            and len(joined) - 1 in apart
            and _joinable(previous, unit, kinds)
            and not _splits(trace, unit, kinds)
        ):
            apart.discard(len(joined) - 1)
            previous.extend(unit)
            continue
        joined.append(list(unit))
        splits.append(_splits(trace, unit, kinds))
    while len(joined) > 1 and not uses.in_unit(joined[0]) and _joinable(joined[0], joined[1], kinds):
        joined[0:2] = [joined[0] + joined[1]]
    return joined


def _splits(trace: Trace, unit: list[fx.Node], kinds: dict[str, str]) -> bool:
    """Whether `unit`, as one layer, would split by height (`split_rules.split_shape`)."""
    inside = set(unit)
    reads = {
        s.name: None
        for n in unit
        for s in n.all_input_nodes
        if s not in inside and kinds.get(s.name, "aux") != "aux"
    }
    outputs = tuple(n.name for n in unit if any(user not in inside for user in n.users))
    return split_shape(trace, LayerCode(tuple(unit), outputs, (("", tuple(reads)),)))[0] > 0


def _reads_alike(before: list[fx.Node], after: list[fx.Node], kinds: dict[str, str]) -> bool:
    """`after` reads `before`'s values, and both are per-rank or neither is."""
    inside = set(before)
    reads = any(source in inside for node in after for source in node.all_input_nodes)
    per_rank = {any(kinds[n.name] == "per_rank" for n in unit) for unit in (before, after)}
    return reads and len(per_rank) == 1


def _unit_names(units: list[list[fx.Node]], taken: set[str], uses: _ParameterUse) -> list[str]:
    """Each unit is named for its first node with parameters (else its first node): its submodule
    (dots as underscores) or, outside any submodule, the node."""
    names = []
    for unit in units:
        first = uses.first_user(unit)
        module = first.meta.get("deeppool_unit")
        base = module.replace(".", "_") if module else first.name
        base = f"_{base}" if base[0].isdigit() else base
        name, n = base, 1
        while name in taken:
            name, n = f"{base}_{n}", n + 1
        taken.add(name)
        names.append(name)
    return names


def _effects(
    trace: Trace, nodes: list[fx.Node], tainted: set[str], units: list[list[fx.Node]], names: list[str]
) -> dict[str, list[fx.Node]]:
    """In-place updates of parameters, buffers or constants that no layer's data reaches (a counter's
    ``add_``): each runs once, in the layer of the same submodule call, else in the next layer."""
    position = {n: i for i, n in enumerate(nodes)}
    first = [position[unit[0]] for unit in units]
    effects: dict[str, list[fx.Node]] = {}
    for node in nodes:
        if node.name in tainted or not _mutates_state(node):
            continue
        stack = trace.stacks.get(node.name, ())
        same = [
            i
            for i, unit in enumerate(units)
            if stack and any(n.meta.get("deeppool_unit") == stack[-1].path for n in unit)
        ]
        later = [i for i, start in enumerate(first) if start > position[node]]
        target = same[0] if same else later[0] if later else len(units) - 1
        effects.setdefault(names[target], []).append(node)
    return effects


def _mutates_state(node: fx.Node) -> bool:
    """An in-place operation whose first argument is a parameter, buffer or constant."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    return node.args[0].op == "get_attr" and _in_place(node)


def _in_place(node: fx.Node) -> bool:
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return bool(schema.is_mutable)
    name = getattr(target, "__name__", "")
    return (
        (name.endswith("_") and not name.startswith("__"))
        or name in ("_setitem", "copy_")
        or bool(node.kwargs.get("inplace"))
    )


def _closure(own: Sequence[fx.Node], tainted: set[str]) -> list[fx.Node]:
    """Auxiliary nodes the given nodes read (through auxiliary nodes), with in-place updates of them."""
    found: dict[fx.Node, None] = {}
    stack = [i for n in own for i in n.all_input_nodes]
    while stack:
        node = stack.pop()
        if node in found or node.op == "placeholder" or node.name in tainted:
            continue
        found[node] = None
        stack.extend(node.all_input_nodes)
        for user in node.users:
            if (
                user.name not in tainted
                and _in_place(user)
                and user.args
                and user.args[0] is node
                and not _mutates_state(user)
            ):
                stack.append(user)
    return list(found)


def _drop_dead_code(graph: fx.Graph) -> None:
    for node in reversed(list(graph.nodes)):
        if node.op in ("placeholder", "output") or node.users:
            continue
        if node.op == "get_attr" or not (_in_place(node) or _target_name(node) == "check_guard"):
            graph.erase_node(node)


class _ParameterUse:
    """Which of `gm`'s parameters nodes use, by name (a shared parameter under its first name)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.names = {id(p): name for name, p in gm.named_parameters()}

    def of(self, nodes: Sequence[fx.Node]) -> list[str]:
        used: dict[str, None] = {}
        for n in nodes:
            if n.op == "call_module":
                for p in self.gm.get_submodule(str(n.target)).parameters():
                    used[self.names[id(p)]] = None
            elif n.op == "get_attr":
                value = fetch_attr(self.gm, str(n.target))
                if isinstance(value, torch.nn.Parameter):
                    used[self.names[id(value)]] = None
        return list(used)

    def in_unit(self, unit: Sequence[fx.Node]) -> bool:
        """Whether the unit's nodes, or the attributes they read, use a parameter."""
        return bool(self.of([*unit, *(s for n in unit for s in n.all_input_nodes if s.op == "get_attr")]))

    def first_user(self, unit: Sequence[fx.Node]) -> fx.Node:
        """The unit's first node that uses a parameter (else its first node): the one it is named for."""
        return next((n for n in unit if self.in_unit([n])), unit[0])


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target.rpartition(".")[2]
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet or target, "__name__", str(target)).rpartition(".")[2]


def _input_meta(leaf: Leaf | None) -> ValueMeta:
    assert leaf is not None
    return ValueMeta(pytree.tree_structure(0), (_leaf_meta(leaf),))


def _leaf_meta(leaf: Leaf) -> LeafMeta:
    if not leaf.batch_dims:
        return LeafMeta(leaf.shape, leaf.dtype)
    if leaf.rows == 1:
        return LeafMeta(leaf.shape[1:], leaf.dtype)
    return LeafMeta(leaf.shape, leaf.dtype, leaf.rows)


def _layer_meta(trace: Trace, outputs: Sequence[str], per_rank: bool) -> ValueMeta:
    metas = [_leaf_meta(leaf) for name in outputs for leaf in trace.leaves[name] if leaf is not None]
    spec = pytree.tree_structure(tuple(_structure(trace, name) for name in outputs))
    return ValueMeta(spec, tuple(metas), per_rank)


def _structure(trace: Trace, name: str) -> Any:
    """A stand-in with the pytree structure of a node's value (its leaves replaced by 0)."""
    node = trace.node(name)
    value = node.meta.get("val")
    if value is not None:
        return pytree.tree_map(lambda _: 0, value)
    return 0 if len(trace.leaves[name]) == 1 else tuple(0 for _ in trace.leaves[name])
