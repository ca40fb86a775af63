"""Branch parallelism: regions of independent branches, run side by side on disjoint ranks."""

import json

import pytest

from lightning_deeppool.ir.graph import GraphInput, LayerGraph
from lightning_deeppool.ir.placement import Placement
from lightning_deeppool.ir.profile import AlphaBeta, CommProfile
from lightning_deeppool.planner import checks, cost
from lightning_deeppool.planner.branches import Region, find_regions
from lightning_deeppool.planner.plan import Plan, plan_with_widths
from lightning_deeppool.planner.search import resolve_pins, search

from planner_fixtures import SLOW_LINK, chain, graph_of, layer, linear_profile

pytestmark = pytest.mark.floors

FAST_LINK = CommProfile(link=AlphaBeta(latency_s=1e-6, seconds_per_byte=1e-12), overlap=False)


def towers(depth: int = 3, *, sample_bytes: int = 256) -> LayerGraph:
    """A two-tower model: ``image -> img0..`` and ``text -> txt0..``, joined by ``logits``."""
    image = [
        layer(f"img{i}", ["image" if i == 0 else f"img{i - 1}"], sample_bytes=sample_bytes, params=1000)
        for i in range(depth)
    ]
    text = [
        layer(f"txt{i}", ["text" if i == 0 else f"txt{i - 1}"], sample_bytes=sample_bytes, params=1000)
        for i in range(depth)
    ]
    logits = layer("logits", [image[-1].name, text[-1].name], sample_bytes=64, module=False)
    return LayerGraph(
        (GraphInput("image", 256), GraphInput("text", 256)), (*image, *text, logits), ("logits",)
    )


def inception() -> LayerGraph:
    """``stem`` forks into four branches (1, 2, 3 and 2 layers deep) joined by ``cat``, then ``head``."""
    stem = layer("stem", ["x"])
    branches = [
        [layer("b0_conv", ["stem"])],
        [layer("b1_reduce", ["stem"]), layer("b1_conv", ["b1_reduce"])],
        [layer("b2_reduce", ["stem"]), layer("b2_conv1", ["b2_reduce"]), layer("b2_conv2", ["b2_conv1"])],
        [layer("b3_pool", ["stem"]), layer("b3_conv", ["b3_pool"])],
    ]
    cat = layer("cat", [b[-1].name for b in branches], module=False)
    return graph_of([stem, *(item for b in branches for item in b), cat, layer("head", ["cat"])])


def names(region: Region) -> list[list[str]]:
    return [list(branch) for branch in region.branches]


# ---------------------------------------------------------------------------- regions
def test_two_towers_from_two_graph_inputs_to_their_join_are_one_region_of_two_branches():
    assert [names(r) for r in find_regions(towers())] == [
        [["img0", "img1", "img2"], ["txt0", "txt1", "txt2"]]
    ]


def test_an_inception_block_is_a_region_of_its_branches_from_the_fork_to_the_concatenation():
    assert [names(r) for r in find_regions(inception())] == [
        [["b0_conv"], ["b1_reduce", "b1_conv"], ["b2_reduce", "b2_conv1", "b2_conv2"], ["b3_pool", "b3_conv"]]
    ]


def test_a_chain_has_no_region():
    assert find_regions(chain(6)) == []


def test_a_residual_block_has_no_region():
    graph = graph_of([layer("a", ["x"]), layer("b", ["a"]), layer("c", ["b"]), layer("add", ["c", "a"])])
    assert find_regions(graph) == []


def test_branches_where_one_reads_the_others_value_are_no_region():
    graph = graph_of(
        [
            layer("fork", ["x"]),
            layer("a0", ["fork"]),
            layer("a1", ["a0"]),
            layer("b0", ["fork", "a1"]),  # reads branch a: b depends on a
            layer("b1", ["b0"]),
            layer("join", ["a1", "b1"]),
        ]
    )
    assert find_regions(graph) == []


def test_a_layer_reading_only_the_fork_is_a_branch_beside_the_layers_before_it():
    graph = graph_of(
        [
            layer("fork", ["x"]),
            layer("a0", ["fork"]),
            layer("a1", ["a0"]),
            layer("b0", ["fork"]),
            layer("b1", ["b0", "a0"]),  # joins a0 and b0: a1 and b0 still run side by side
            layer("join", ["a1", "b1"]),
        ]
    )
    assert [names(r) for r in find_regions(graph)] == [[["a0", "a1"], ["b0"]]]


def test_heads_of_a_multi_task_model_are_branches_up_to_the_graph_outputs():
    trunk = [layer("t0", ["x"]), layer("t1", ["t0"])]
    heads = [layer("h0", ["t1"]), layer("h0_out", ["h0"]), layer("h1", ["t1"]), layer("h1_out", ["h1"])]
    graph = graph_of([*trunk, *heads], outputs=["h0_out", "h1_out"])
    assert [names(r) for r in find_regions(graph)] == [[["h0", "h0_out"], ["h1", "h1_out"]]]


def test_a_layer_reducing_over_each_ranks_samples_ends_a_region_before_it():
    graph = towers()
    loss = layer("loss", ["txt1"], module=False)
    per_rank = LayerGraph(
        graph.inputs,
        (*graph.layers[:5], type(loss)(**{**loss.__dict__, "per_rank": True}), *graph.layers[5:]),
        graph.outputs,
    )
    assert [names(r) for r in find_regions(per_rank)] == [[["img0", "img1", "img2"], ["txt0", "txt1"]]]


# ---------------------------------------------------------------------------- cost
def _equal_towers(depth: int = 3):
    graph = towers(depth)
    profile = linear_profile(
        graph, {item.name: (1e-3, 0.0) for item in graph.layers}, max_batch=8, comm=FAST_LINK
    )
    return graph, profile


def test_two_equal_branches_on_disjoint_halves_cost_about_one_branch_not_both():
    graph, profile = _equal_towers()
    halves = {
        **dict.fromkeys(["img0", "img1", "img2"], Placement(2)),
        **dict.fromkeys(["txt0", "txt1", "txt2"], Placement(2, 1, 2)),
        "logits": Placement(4),
    }
    step = cost.evaluate(graph, profile, halves, world_size=4, global_batch_size=8)
    # Each layer takes 1 ms at any width: the towers take 3 ms side by side, then 1 ms for logits.
    assert step.serial_s == pytest.approx(7e-3, rel=0.01)
    assert step.total_s == pytest.approx(4e-3, rel=0.01)
    assert step.concurrent_s == pytest.approx(3e-3, rel=0.01)


def test_branches_sharing_rank_zero_run_one_after_the_other():
    graph, profile = _equal_towers()
    overlapping = {
        **dict.fromkeys((item.name for item in graph.layers), Placement(2)),
        "logits": Placement(4),
    }
    step = cost.evaluate(graph, profile, overlapping, world_size=4, global_batch_size=8)
    assert step.concurrent_s == 0
    assert step.total_s == step.serial_s


def test_a_layer_off_rank_zero_sends_its_summed_gradients_to_rank_zero_as_a_two_device_all_reduce():
    big = layer("fc", ["x"], params=1_000_000)
    among_two = SLOW_LINK.allreduce_time(2, 4_000_000)
    assert cost.sync_time(SLOW_LINK, big, Placement(1)) == 0.0
    assert cost.sync_time(SLOW_LINK, big, Placement(1, 1, 3)) == among_two
    assert cost.sync_time(SLOW_LINK, big, Placement(2)) == among_two
    assert cost.sync_time(SLOW_LINK, big, Placement(2, 1, 2)) == 2 * among_two


def test_moving_a_value_between_disjoint_halves_moves_every_sample():
    # 8 samples: ranks 0-1 hold 4 each, ranks 2-3 receive 4 each; the busiest rank moves 4 samples.
    shares = cost.busiest_shares([Placement(2), Placement(2, 1, 2)], 1, 4, 8)
    assert shares[0, 1] == 4
    seconds = cost.transfer_time(
        SLOW_LINK, 1000, Placement(2), Placement(2, 1, 2), world_size=4, global_batch_size=8
    )
    assert seconds == pytest.approx(2 * SLOW_LINK.redistribute_time(4000))


@pytest.mark.parametrize("contention", [0.0, 0.5])
def test_without_layers_side_by_side_the_schedule_is_the_serial_step_less_the_hidden_sync(contention):
    graph = towers()
    comm = CommProfile(link=AlphaBeta(20e-6, 1e-9), overlap=True, contention=contention)
    profile = linear_profile(
        graph, {item.name: (1e-3, 1e-4) for item in graph.layers}, max_batch=8, comm=comm
    )
    widths = {"img0": 4, "img1": 2, "img2": 2, "txt0": 1, "txt1": 4, "txt2": 4, "logits": 4}
    placements = {name: Placement(width) for name, width in widths.items()}
    step = cost.evaluate(graph, profile, placements, world_size=4, global_batch_size=8)
    synced = cost.synced_bytes(graph, widths)
    buckets = cost.sync_buckets(graph, placements, step.layers, synced, comm)
    allreduce = {name: c.sync_s for name, c in step.layers.items()}
    scheduled = cost.scheduled_step(
        graph, placements, step.layers, buckets, allreduce, world_size=4, overlap=True, contention=contention
    )
    assert step.hidden_s > 0
    assert (step.contention_s > 0) == (contention > 0)
    assert scheduled == pytest.approx(step.serial_s - step.hidden_s + step.contention_s)


# ---------------------------------------------------------------------------- search
def test_towers_that_do_not_scale_run_side_by_side_on_disjoint_ranks():
    graph, profile = _equal_towers()
    plan = search(graph, profile, world_size=4, global_batch_size=8, amplification_limit=float("inf"))
    image = {plan.placements()[f"img{i}"] for i in range(3)}
    text = {plan.placements()[f"txt{i}"] for i in range(3)}
    assert len(image) == len(text) == 1
    (a,), (b,) = image, text
    assert set(a.ranks).isdisjoint(b.ranks)
    assert plan.predicted_step_time_s == pytest.approx(4e-3, rel=0.02)
    assert plan.predicted_ddp_step_time_s == pytest.approx(7e-3, rel=0.02)


def test_towers_that_scale_well_stay_data_parallel():
    graph = towers()
    profile = linear_profile(
        graph, {item.name: (1e-6, 1e-3) for item in graph.layers}, max_batch=8, comm=FAST_LINK
    )
    plan = search(graph, profile, world_size=4, global_batch_size=8)
    assert set(plan.placements().values()) == {Placement(4)}


def test_without_branches_every_layer_starts_at_rank_zero():
    graph, profile = _equal_towers()
    sizes = dict(world_size=4, global_batch_size=8, amplification_limit=float("inf"))
    plan = search(graph, profile, **sizes, branches=False)
    assert all(p.first == 0 for p in plan.placements().values())
    assert plan.predicted_step_time_s > search(graph, profile, **sizes).predicted_step_time_s


def test_the_plan_with_branches_is_never_predicted_slower_than_full_width():
    graph = inception()
    for fixed, per_sample in ((1e-3, 0.0), (1e-4, 1e-4), (1e-6, 1e-3)):
        profile = linear_profile(
            graph, {item.name: (fixed, per_sample) for item in graph.layers}, max_batch=8
        )
        plan = search(graph, profile, world_size=8, global_batch_size=8, amplification_limit=float("inf"))
        assert plan.predicted_step_time_s <= plan.predicted_ddp_step_time_s


def test_a_region_with_a_pinned_layer_keeps_every_layer_from_rank_zero():
    graph, profile = _equal_towers()
    plan = search(
        graph, profile, world_size=4, global_batch_size=8, amplification_limit=float("inf"), pins={"img1": 2}
    )
    assert all(p.first == 0 for p in plan.placements().values())


# ---------------------------------------------------------------------------- plans and pins
def _branch_plan() -> Plan:
    graph, profile = _equal_towers()
    placements = {
        **{name: {"ranks": [0, 1]} for name in ("img0", "img1", "img2")},
        **{name: {"ranks": [2, 3]} for name in ("txt0", "txt1", "txt2")},
        "logits": 4,
    }
    return plan_with_widths(
        graph, profile, placements, world_size=4, global_batch_size=8, amplification_limit=2.0
    )


def test_a_plan_round_trips_through_json_with_each_layers_ranks():
    plan = _branch_plan()
    data = json.loads(plan.to_json())
    assert [item.get("first", 0) for item in data["layers"]] == [0, 0, 0, 2, 2, 2, 0]
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.placements()["txt0"] == Placement(2, 1, 2)


def test_the_table_shows_each_layers_ranks_and_what_running_side_by_side_saves():
    lines = _branch_plan().table().splitlines()
    assert lines[0].split()[:4] == ["layer", "module", "width", "ranks"]
    assert lines[1].split()[:4] == ["img0", "img0", "2", "0-1"]
    assert lines[4].split()[:4] == ["txt0", "txt0", "2", "2-3"]
    assert "layers on disjoint ranks side by side save 3.0" in lines[8]


def test_idle_fractions_count_branches_side_by_side_as_busy():
    assert _branch_plan().idle_fractions() == pytest.approx([0.0] * 4, abs=0.01)


@pytest.mark.parametrize(
    ("pin", "expected"),
    [
        ({"ranks": [2, 3]}, Placement(2, 1, 2)),
        ({"ranks": [1]}, Placement(1, 1, 1)),
        (Placement(2, 1, 2), Placement(2, 1, 2)),
    ],
)
def test_a_pin_may_name_a_range_of_ranks(pin, expected):
    graph = towers()
    assert resolve_pins(graph, {"txt0": pin}, 4)["txt0"] == expected


def test_a_range_of_ranks_may_split_samples_by_height():
    assert checks.as_placement({"ranks": [2, 3], "spatial": 2}, "pin 'a'") == Placement(2, 2, 2)


@pytest.mark.parametrize(
    ("pin", "message"),
    [
        ({"ranks": [1, 3]}, r"pin 'txt0': ranks \[1, 3\] are not consecutive ranks"),
        ({"ranks": [3, 4]}, r"pin 'txt0': ranks 3..4 are not all in a world of 4 ranks"),
        ({"ranks": []}, r"pin 'txt0': ranks \[\] are not a non-empty list of ints"),
        ({"ranks": [2, 3], "width": 3}, r"pin 'txt0': width 3 but 2 ranks \[2, 3\]"),
    ],
)
def test_a_pin_with_ranks_that_are_not_a_range_in_the_world_is_an_error(pin, message):
    with pytest.raises(ValueError, match=message):
        resolve_pins(towers(), {"txt0": pin}, 4)


def test_a_plan_with_ranks_outside_the_world_is_refused():
    graph, profile = _equal_towers()
    widths = {**dict.fromkeys((item.name for item in graph.layers), 4), "txt0": Placement(2, 1, 3)}
    with pytest.raises(ValueError, match=r"layer 'txt0': ranks 3..4 are not all in a world of 4 ranks"):
        plan_with_widths(graph, profile, widths, world_size=4, global_batch_size=8, amplification_limit=2.0)
