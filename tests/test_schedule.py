"""`lowering/schedule.py`: stages, action lists, round trips, gradient placement, bucket readiness,
and a single-process simulation of every rank's communication (no deadlock for any widths)."""

from __future__ import annotations

import random

import pytest

from lightning_deeppool.ir.buckets import cut_into_buckets
from lightning_deeppool.ir.graph import GraphInput, Layer, LayerGraph
from lightning_deeppool.ir.placement import Layout, Placement, pieces
from lightning_deeppool.lowering.schedule import Action, Schedule, build_schedule, build_stages

pytestmark = pytest.mark.floors

# x -> a -> b -> add(a, b) -> c ; cat(add, c) -> head: a residual join and a concatenation.
GRAPH = LayerGraph(
    inputs=(GraphInput("x", 16),),
    layers=(
        Layer("a", "call_module", "a", ("x",), 16, 4, 16),
        Layer("b", "call_module", "b", ("a",), 16, 4, 16),
        Layer("add", "call_function", "add", ("a", "b"), 16),
        Layer("c", "call_module", "c", ("add",), 16, 4, 16),
        Layer("cat", "call_function", "cat", ("add", "c"), 32),
        Layer("head", "call_module", "head", ("cat",), 4, 8, 32),
    ),
    outputs=("head",),
)
PARAMS = {"a": ["a.w"], "b": ["b.w"], "c": ["c.w"], "head": ["head.w"]}
BYTES = {"a.w": 16, "b.w": 16, "c.w": 16, "head.w": 32}


def _schedule(widths: dict[str, int], world: int, bucket_bytes: int = 1 << 20) -> Schedule:
    return build_schedule(GRAPH, widths, PARAMS, BYTES, world, bucket_bytes)


MIXED = {"a": 3, "b": 2, "add": 2, "c": 1, "cat": 3, "head": 1}


def test_stages_are_maximal_runs_of_equal_width_with_their_boundary_values():
    stages = build_stages(GRAPH, MIXED)
    assert [(s.width, s.layers) for s in stages] == [
        (3, ("a",)),
        (2, ("b", "add")),
        (1, ("c",)),
        (3, ("cat",)),
        (1, ("head",)),
    ]
    assert stages[1].inputs == ("a",) and stages[1].outputs == ("add",)
    assert stages[3].inputs == ("add", "c")


def test_forward_sends_each_value_once_per_new_width_before_its_first_use():
    forward = [str(a) for a in _schedule(MIXED, 3).forward]
    assert forward == [
        "forward0",
        "send:a:3>2",
        "forward1",
        "send:add:2>1",
        "forward2",
        "send:add:2>3",
        "send:c:1>3",
        "forward3",
        "send:cat:3>1",
        "forward4",
        "send:head:1>3",
    ]


TOWERS = LayerGraph(
    inputs=(GraphInput("x", 16), GraphInput("y", 16)),
    layers=(
        Layer("a", "call_module", "a", ("x",), 16, 4, 16),
        Layer("b", "call_module", "b", ("y",), 16, 4, 16),
        Layer("join", "call_function", "add", ("a", "b"), 16),
    ),
    outputs=("join",),
)


def test_a_branch_on_other_ranks_gets_its_inputs_before_the_branch_beside_it_computes():
    placements = {"a": Placement(1), "b": Placement(1, 1, 1), "join": Placement(2)}
    schedule = build_schedule(TOWERS, placements, {"a": ["a.w"], "b": ["b.w"]}, {"a.w": 16, "b.w": 16}, 2)
    assert [str(a) for a in schedule.forward] == [
        "send:x:2>1",
        "send:y:2>1@1",
        "forward0",
        "forward1",
        "send:a:1>2",
        "send:b:1@1>2",
        "forward2",
    ]


def test_backward_returns_every_sent_gradient_after_the_stage_that_read_it():
    backward = [str(a) for a in _schedule(MIXED, 3).backward]
    assert backward == [
        "send_grad:head:1>3",
        "backward4",
        "send_grad:cat:3>1",
        "backward3",
        "send_grad:add:2>3",
        "send_grad:c:1>3",
        "backward2",
        "send_grad:add:2>1",
        "backward1",
        "send_grad:a:3>2",
        "sync0",
        "backward0",
        "sync1",
        "wait",
    ]


def test_buckets_skip_width_one_parameters_and_sync_once_final():
    schedule = _schedule(MIXED, 3)
    assert [(b.ranks, b.params) for b in schedule.buckets] == [((0, 1), ("b.w",)), ((0, 1, 2), ("a.w",))]
    assert schedule.param_ranks == {"a.w": (0, 1, 2), "b.w": (0, 1), "c.w": (0,), "head.w": (0,)}
    assert schedule.owns(1, "b.w") and not schedule.owns(2, "b.w") and not schedule.owns(1, "head.w")


def test_a_layer_on_other_ranks_than_rank_zero_is_owned_by_them_and_rank_zero():
    schedule = _schedule({**MIXED, "b": Placement(2, 1, 1), "head": Placement(1, 1, 2)}, 3)
    assert schedule.param_ranks["b.w"] == (1, 2) and schedule.owners("b.w") == (0, 1, 2)
    assert schedule.owners("head.w") == (0, 2) and not schedule.owns(1, "head.w")
    assert schedule.to_rank_zero(0) == {1: ["b.w"], 2: ["head.w"]}
    assert schedule.to_rank_zero(1) == {0: ["b.w"]} and schedule.to_rank_zero(2) == {0: ["head.w"]}


def test_buckets_split_at_the_size_limit():
    schedule = _schedule(dict.fromkeys(MIXED, 2), 2, bucket_bytes=32)
    assert [b.params for b in schedule.buckets] == [("head.w",), ("c.w", "b.w"), ("a.w",)]


def test_the_first_bucket_holds_at_most_a_megabyte_so_an_all_reduce_starts_early_in_backward():
    megabyte = 1 << 20
    sizes = {"a.w": megabyte // 2, "b.w": megabyte // 2, "c.w": megabyte // 2, "head.w": megabyte // 2}
    schedule = build_schedule(GRAPH, dict.fromkeys(MIXED, 2), PARAMS, sizes, 2, bucket_bytes=25 * megabyte)
    assert [b.params for b in schedule.buckets] == [("head.w", "c.w"), ("b.w", "a.w")]


def test_a_gradient_larger_than_the_first_bucket_closes_it_so_its_all_reduce_starts_once_it_is_final():
    # A small classifier, then a layer whose gradient alone fills the first bucket (the compute-bound
    # CNN of the benchmarks): the first bucket closes with that gradient, as DDP's does, instead of
    # leaving it to wait for the whole backward in the next, 25 MB bucket (or costing a call alone).
    megabyte = 1 << 20
    sizes = {"a.w": 1024, "b.w": 1024, "c.w": megabyte + 1024, "head.w": 1024}
    schedule = build_schedule(GRAPH, dict.fromkeys(MIXED, 2), PARAMS, sizes, 2, bucket_bytes=25 * megabyte)
    assert [b.params for b in schedule.buckets] == [("head.w", "c.w"), ("b.w", "a.w")]


def test_a_gradient_as_large_as_a_whole_bucket_goes_alone():
    megabyte = 1 << 20
    sizes = {"a.w": 1024, "b.w": 30 * megabyte, "c.w": 1024, "head.w": 1024}
    schedule = build_schedule(GRAPH, dict.fromkeys(MIXED, 2), PARAMS, sizes, 2, bucket_bytes=25 * megabyte)
    assert [b.params for b in schedule.buckets] == [("head.w", "c.w"), ("b.w",), ("a.w",)]


def test_only_the_steps_first_bucket_closes_early():
    # The profiler's calibration cuts a whole pass's gradients with the rule the schedule uses.
    megabyte = 1 << 20
    sized = [("a", megabyte // 2), ("b", megabyte // 2), ("c", megabyte), ("d", 4 * megabyte)]
    assert cut_into_buckets(sized, 4 * megabyte, first=True) == [["a", "b"], ["c"], ["d"]]
    assert cut_into_buckets(sized, 4 * megabyte, first=False) == [["a", "b", "c"], ["d"]]


def test_every_action_round_trips_through_its_text():
    schedule = _schedule(MIXED, 3)
    for action in (*schedule.forward, *schedule.backward):
        assert Action.from_str(str(action)) == action


def test_from_str_rejects_text_that_is_no_action():
    with pytest.raises(ValueError, match="not an action: 'forwardx'"):
        Action.from_str("forwardx")


def _comms(schedule: Schedule, rank: int, counts: tuple[int, ...]) -> list[tuple]:
    """The communication rank `rank` takes part in, in order, as the runtime issues it."""
    world = schedule.world_size

    def layout(placement: Placement) -> Layout:
        home = placement == Placement(world)
        return Layout(counts, 1, world) if home else Layout.of(placement, sum(counts), world)

    ops: list[tuple] = [("collective", tuple(range(world)), "agree")]
    for action in (*schedule.forward, *schedule.backward):
        if action.kind in ("send", "send_grad"):
            src, dst = layout(action.src), layout(action.dst)
            if action.kind == "send_grad":
                src, dst = dst, src
            batch = frozenset(
                (move.src, move.dst, str(action))
                for move in pieces(src, dst, 1)
                if rank in (move.src, move.dst)
            )
            if batch:
                ops.append(("p2p", batch))
        elif action.kind == "sync" and rank in schedule.buckets[action.number].ranks:
            ops.append(("collective", schedule.buckets[action.number].ranks, str(action)))
    moves = schedule.to_rank_zero(rank)
    if moves:
        ops.append(("p2p", frozenset((peer, 0, "to0") if rank == 0 else (rank, 0, "to0") for peer in moves)))
    return ops


def _simulate_lists(ops: list[list[tuple]]) -> None:
    """Run every rank's communication: a message is delivered once both ends have posted it, a P2P
    batch finishes when all its messages are delivered, a collective when all members are at it.
    Fail when no rank can make progress."""
    world = len(ops)
    position = [0] * world
    delivered: set[tuple] = set()

    def current(rank: int) -> tuple | None:
        return ops[rank][position[rank]] if position[rank] < len(ops[rank]) else None

    while any(current(r) is not None for r in range(world)):
        for rank in range(world):
            op = current(rank)
            if op is not None and op[0] == "p2p":
                for move in op[1]:
                    peer = current(move[1] if move[0] == rank else move[0])
                    if peer is not None and peer[0] == "p2p" and move in peer[1]:
                        delivered.add(move)
        done = [
            rank
            for rank in range(world)
            if (op := current(rank)) is not None
            and (all(current(m) == op for m in op[1]) if op[0] == "collective" else op[1] <= delivered)
        ]
        if not done:
            stuck = {r: current(r) for r in range(world) if current(r) is not None}
            raise AssertionError(f"deadlock: {stuck}")
        for rank in done:
            position[rank] += 1


def _random_placement(rng: random.Random, world: int) -> Placement:
    width = rng.randint(1, world)
    return Placement(width, 1, rng.randint(0, world - width))


@pytest.mark.parametrize("seed", range(30))
def test_random_placements_never_deadlock(seed):
    rng = random.Random(seed)
    world = rng.randint(2, 5)
    widths = {layer.name: _random_placement(rng, world) for layer in GRAPH.layers}
    counts = tuple(rng.randint(1, 6) for _ in range(world))
    schedule = _schedule(widths, world, bucket_bytes=rng.choice([16, 1 << 20]))
    _simulate_lists([_comms(schedule, rank, counts) for rank in range(world)])


def test_simulator_detects_ranks_that_sync_buckets_in_different_orders():
    schedule = _schedule(dict.fromkeys(MIXED, 2), 2, bucket_bytes=16)
    reordered = Schedule(**{**schedule.__dict__, "backward": tuple(reversed(schedule.backward))})
    ops = [_comms(schedule, 0, (2, 2)), _comms(reordered, 1, (2, 2))]
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate_lists(ops)
