"""The burst-parallel step as data: stages, actions and the passes that lower a plan into them.

Every rank derives the same action lists from the same graph and placements, so collectives are
issued in one order everywhere, in forward and in backward. A rank executes the actions it takes part
in: `forward`/`backward` of a stage when it is one of the stage's ranks, `send`/`send_grad` when it
holds or receives samples that move, `sync` when it runs the bucket's parameters. Stages on disjoint
rank sets (independent branches) therefore run side by side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from lightning_deeppool.ir.buckets import cut_into_buckets
from lightning_deeppool.ir.graph import LayerGraph
from lightning_deeppool.ir.placement import Placement, equal_width_runs
from lightning_deeppool.ir.profile import DEFAULT_BUCKET_BYTES


@dataclass(frozen=True)
class Stage:
    """A run of consecutive layers with one placement; `inputs`/`outputs` cross its boundary."""

    index: int
    placement: Placement
    layers: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def width(self) -> int:
        return self.placement.width

    @property
    def ranks(self) -> range:
        return self.placement.ranks


@dataclass(frozen=True)
class Bucket:
    """Parameters whose gradients are all-reduced together among `ranks`."""

    index: int
    ranks: tuple[int, ...]
    params: tuple[str, ...]


class Action(NamedTuple):
    """One step of the schedule.

    kind: "forward" / "backward" (of stage `number`), "send" (a value's samples move from placement
    `src` to `dst`), "send_grad" (its gradient moves back from `dst` to `src`), "sync" (all-reduce
    bucket `number`), "wait" (finish all syncs).
    """

    kind: str
    number: int = -1
    value: str = ""
    src: Placement = Placement(0)
    dst: Placement = Placement(0)

    def __str__(self) -> str:
        if self.kind in ("send", "send_grad"):
            return f"{self.kind}:{self.value}:{self.src}>{self.dst}"
        if self.kind == "wait":
            return "wait"
        return f"{self.kind}{self.number}"

    @classmethod
    def from_str(cls, text: str) -> Action:
        if text == "wait":
            return cls("wait")
        if text.startswith(("send:", "send_grad:")):
            kind, value, widths = text.split(":")
            src, dst = widths.split(">")
            return cls(kind, value=value, src=Placement.parse(src), dst=Placement.parse(dst))
        for kind in ("forward", "backward", "sync"):
            if text.startswith(kind) and text[len(kind) :].isdigit():
                return cls(kind, number=int(text[len(kind) :]))
        raise ValueError(f"not an action: {text!r}")


@dataclass(frozen=True)
class Schedule:
    """Everything a rank needs to run one step of a plan. `param_ranks`: per parameter, the ranks that
    run a layer using it (its gradient is summed among them); its owners are those and rank 0, which
    holds every parameter (its gradient reaches rank 0 after the sum where rank 0 runs none of them)."""

    world_size: int
    placements: dict[str, Placement]
    stages: tuple[Stage, ...]
    buckets: tuple[Bucket, ...]
    forward: tuple[Action, ...]
    backward: tuple[Action, ...]
    param_ranks: dict[str, tuple[int, ...]]

    def owners(self, param: str) -> tuple[int, ...]:
        """The ranks that hold `param` (every rank for a parameter no planned layer uses)."""
        ranks = self.param_ranks.get(param)
        return tuple(range(self.world_size)) if ranks is None else tuple(sorted({0, *ranks}))

    def owns(self, rank: int, param: str) -> bool:
        return rank in self.owners(param)

    def to_rank_zero(self, rank: int) -> dict[int, list[str]]:
        """Parameters whose summed gradient moves to rank 0 (which runs none of their layers), by the
        peer `rank` exchanges them with: on rank 0, each sender (the first of the parameter's ranks);
        on a sender, rank 0. Empty elsewhere."""
        moves: dict[int, list[str]] = {}
        for param, ranks in self.param_ranks.items():
            if 0 not in ranks and rank in (0, ranks[0]):
                moves.setdefault(ranks[0] if rank == 0 else 0, []).append(param)
        return moves


def build_stages(graph: LayerGraph, given: Mapping[str, Placement | int]) -> tuple[Stage, ...]:
    """Cut the execution order into maximal runs of equal placement."""
    placements = {name: Placement.of(p) for name, p in given.items()}
    runs = equal_width_runs((layer.name for layer in graph.layers), placements)
    stage_of = {name: i for i, run in enumerate(runs) for name in run}
    graph_outputs = set(graph.outputs)
    stages = []
    for i, run in enumerate(runs):
        inputs: dict[str, None] = {}
        for name in run:
            for source in graph.layer(name).inputs:
                if stage_of.get(source) != i:
                    inputs[source] = None
        outputs = [
            name
            for name in run
            if name in graph_outputs or any(stage_of[c] != i for c in graph.consumers(name))
        ]
        stages.append(Stage(i, placements[run[0]], tuple(run), tuple(inputs), tuple(outputs)))
    return tuple(stages)


def lower_forward(graph: LayerGraph, stages: Sequence[Stage], world_size: int) -> list[Action]:
    """Stage computations with a `send` before each first use of a value at another placement. The
    inputs of a later stage on ranks disjoint from a stage's (a branch beside it) that are ready move
    before that stage computes, so the other branch's ranks do not wait for it."""
    home = Placement(world_size)
    placements = {name: stage.placement for stage in stages for name in stage.layers}
    produced = {name: -1 for name in (i.name for i in graph.inputs)}  # value -> its stage (-1: input)
    available = {(name, home) for name in produced}
    actions: list[Action] = []

    def need(value: str, placement: Placement) -> None:
        source = placements.get(value, home)
        available.add((value, source))
        if (value, placement) not in available:
            actions.append(Action("send", value=value, src=source, dst=placement))
            available.add((value, placement))

    for stage in stages:
        for value in stage.inputs:
            need(value, stage.placement)
        for later in stages[stage.index + 1 :]:
            if later.ranks.stop <= stage.ranks.start or stage.ranks.stop <= later.ranks.start:
                for value in later.inputs:
                    if produced.get(value, stage.index) < stage.index:
                        need(value, later.placement)
        actions.append(Action("forward", stage.index))
        produced.update(dict.fromkeys(stage.layers, stage.index))
    for value in graph.outputs:
        need(value, home)
    return actions


def lower_backward(
    graph: LayerGraph,
    stages: Sequence[Stage],
    forward: Sequence[Action],
    buckets: Sequence[Bucket],
    ready_after: Mapping[int, Sequence[int]],
) -> list[Action]:
    """Reverse of `forward`: each `send` becomes a `send_grad` placed after the backward of the last
    stage (in reverse order) that read the value at that width; buckets sync once ready. Gradients of
    graph inputs move back only in steps whose inputs require grad (the runtime skips them otherwise)."""
    last_reader: dict[tuple[str, Placement], int] = {}
    for stage in stages:
        for value in stage.inputs:
            last_reader.setdefault((value, stage.placement), stage.index)
    grads_after: dict[int, list[Action]] = {}
    output_grads: list[Action] = []
    for action in forward:
        if action.kind != "send":
            continue
        grad = Action("send_grad", value=action.value, src=action.src, dst=action.dst)
        reader = last_reader.get((action.value, action.dst))
        if reader is None:
            output_grads.append(grad)
        else:
            grads_after.setdefault(reader, []).append(grad)
    actions = list(reversed(output_grads))
    for stage in reversed(stages):
        actions.append(Action("backward", stage.index))
        actions.extend(grads_after.get(stage.index, []))
        actions.extend(Action("sync", b) for b in ready_after.get(stage.index, []))
    actions.append(Action("wait"))
    return actions


def plan_buckets(
    stages: Sequence[Stage],
    layer_params: Mapping[str, Sequence[str]],
    param_bytes: Mapping[str, int],
    param_ranks: Mapping[str, tuple[int, ...]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> tuple[list[Bucket], dict[int, list[int]]]:
    """Group gradients by the ranks that sum them, in the order they become final in backward.

    Returns the buckets and, per stage index, the buckets that can be launched after its backward.
    A parameter is final once every stage using it has run backward. Parameters one rank runs need no
    all-reduce and are left out. Buckets are cut by `cut_into_buckets`.
    """
    first_user: dict[str, int] = {}
    for stage in stages:
        for layer in stage.layers:
            for param in layer_params.get(layer, ()):
                first_user.setdefault(param, stage.index)
    buckets: list[Bucket] = []
    ready_after: dict[int, list[int]] = {}
    for stage in reversed(stages):
        # Backward meets a stage's parameters in reverse forward order: bucket them that way.
        final = [p for p, s in first_user.items() if s == stage.index and len(param_ranks[p]) > 1][::-1]
        by_ranks: dict[tuple[int, ...], list[str]] = {}
        for param in final:
            by_ranks.setdefault(param_ranks[param], []).append(param)
        for ranks in sorted(by_ranks, key=lambda r: (len(r), r)):
            sized = [(param, param_bytes[param]) for param in by_ranks[ranks]]
            for chunk in cut_into_buckets(sized, bucket_bytes, first=not buckets):
                buckets.append(Bucket(len(buckets), ranks, tuple(chunk)))
                ready_after.setdefault(stage.index, []).append(buckets[-1].index)
    return buckets, ready_after


def param_ranks(
    placements: Mapping[str, Placement], layer_params: Mapping[str, Sequence[str]]
) -> dict[str, tuple[int, ...]]:
    """The ranks that run some layer using each parameter, sorted."""
    ranks: dict[str, set[int]] = {}
    for layer, params in layer_params.items():
        for param in params:
            ranks.setdefault(param, set()).update(placements[layer].ranks)
    return {param: tuple(sorted(found)) for param, found in ranks.items()}


def build_schedule(
    graph: LayerGraph,
    placements: Mapping[str, Placement | int],
    layer_params: Mapping[str, Sequence[str]],
    param_bytes: Mapping[str, int],
    world_size: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Schedule:
    """Lower a placement (or a width) per layer into the action lists every rank runs."""
    placed = {name: Placement.of(p) for name, p in placements.items()}
    stages = build_stages(graph, placed)
    forward = lower_forward(graph, stages, world_size)
    ranks = param_ranks(placed, layer_params)
    buckets, ready_after = plan_buckets(stages, layer_params, param_bytes, ranks, bucket_bytes)
    backward = lower_backward(graph, stages, forward, buckets, ready_after)
    return Schedule(
        world_size=world_size,
        placements=placed,
        stages=stages,
        buckets=tuple(buckets),
        forward=tuple(forward),
        backward=tuple(backward),
        param_ranks=ranks,
    )
