"""Estimated memory per rank: held parameters with gradients and optimizer state, plus the activations
kept for backward (profiled, else each layer's output), each computed by hand for small graphs; the
plan's footer and JSON carry it."""

from dataclasses import replace

import pytest

from lightning_deeppool.ir.graph import LayerGraph, Tied
from lightning_deeppool.ir.placement import Placement
from lightning_deeppool.planner import memory
from lightning_deeppool.planner.plan import Plan, plan_with_widths

from planner_fixtures import chain, conv, graph_of, layer, linear_profile

SIZES = {"world_size": 2, "global_batch_size": 4}


def two_layers(scale: int = 1) -> LayerGraph:
    """``l0``: 100 parameters (400 bytes), outputs 1000 bytes a sample; ``l1``: 1000 parameters
    (4000 bytes), outputs 10 bytes a sample; every size times `scale`."""
    return graph_of(
        [
            layer("l0", ["x"], sample_bytes=1000 * scale, params=100 * scale),
            layer("l1", ["l0"], sample_bytes=10 * scale, params=1000 * scale),
        ]
    )


def test_a_narrow_layer_counts_only_on_its_ranks():
    # rank 0: 4400 parameter bytes x 3 (param, grad, momentum) + 2 samples x 1000 + 4 samples x 10,
    # and l1's copy of the 4 samples of l0's output it gathers (4 x 1000)
    # rank 1: l0's 400 x 3 + its 2 samples x 1000; l1 is not on it
    assert memory.memory_per_rank(two_layers(), {"l0": 2, "l1": 1}, **SIZES) == (19240, 3200)


def test_rank_zero_holds_every_parameter_even_of_a_layer_it_does_not_run():
    placements = {"l0": Placement(2), "l1": Placement(1, first=1)}
    # rank 0 updates l1's parameters but keeps none of its activations; rank 1 runs both, l1 on a copy
    # of l0's 4 samples
    found = memory.memory_per_rank(two_layers(), placements, **SIZES)
    assert found == (4400 * 3 + 2000, 4400 * 3 + 2000 + 40 + 4000)


def two_layers_profile(
    optimizer_states: float = 1.0, kept: dict[str, int] | None = None, saved_inputs: int | None = None
):
    """`two_layers` profiled: `kept` activation bytes a sample, every layer saving `saved_inputs` bytes
    of its input a sample (not recorded: None)."""
    graph = two_layers()
    times = {"l0": (1e-3, 1e-4), "l1": (1e-3, 1e-4)}
    profile = linear_profile(graph, times, max_batch=4, activation_bytes_per_sample=kept)
    if saved_inputs is not None:
        layers = {
            name: replace(item, saved_input_bytes=tuple(saved_inputs * b for b in item.batch_sizes))
            for name, item in profile.layers.items()
        }
        profile = replace(profile, layers=layers)
    return graph, replace(profile, optimizer_states=optimizer_states)


@pytest.mark.parametrize(("states", "rank_one"), [(0.0, 400 * 2 + 2000), (2.0, 400 * 4 + 2000)])
def test_the_profiles_optimizer_states_multiply_the_held_parameters(states, rank_one):
    graph, profile = two_layers_profile(states)
    found = memory.memory_per_rank(graph, {"l0": 2, "l1": 1}, **SIZES, profile=profile)
    assert found[1] == rank_one


def test_profiled_activations_replace_each_layers_output_bytes():
    # l0 keeps 3000 bytes a sample (its output and what autograd saved) where its output is 1000
    graph, profile = two_layers_profile(kept={"l0": 3000, "l1": 10})
    found = memory.memory_per_rank(graph, {"l0": 2, "l1": 1}, **SIZES, profile=profile)
    assert found == (4400 * 3 + 2 * 3000 + 4 * 10 + 4 * 1000, 400 * 3 + 2 * 3000)


@pytest.mark.parametrize(("saved", "copy"), [(0, 0), (500, 500), (1000, 1000)])
def test_a_layer_keeps_of_an_input_copy_what_it_saves_of_its_input(saved, copy):
    # l1 gathers l0's 4 samples (1000 bytes each) on rank 0, and keeps what autograd saves of them
    graph, profile = two_layers_profile(kept={"l0": 1000, "l1": 10}, saved_inputs=saved)
    found = memory.memory_per_rank(graph, {"l0": 2, "l1": 1}, **SIZES, profile=profile)
    assert found[0] == 4400 * 3 + 2 * 1000 + 4 * 10 + 4 * copy


def test_a_layer_on_other_ranks_keeps_its_activations_there_and_its_parameters_on_rank_zero_too():
    graph = chain(2, params=1000)  # 4000 parameter bytes a layer
    profile = linear_profile(
        graph,
        dict.fromkeys(["l0", "l1"], (1e-3, 1e-4)),
        max_batch=8,
        activation_bytes_per_sample={"l0": 100, "l1": 10},
    )
    placements = {"l0": Placement(2), "l1": Placement(2, 1, 2)}
    found = memory.memory_per_rank(graph, placements, world_size=4, global_batch_size=8, profile=profile)
    # each layer runs on a copy of its 4 samples of its input (4096 bytes a sample), from other ranks
    l0, l1 = 4 * (100 + 4096) + 4000 * 3, 4 * (10 + 4096) + 4000 * 3
    assert found == (l0 + 4000 * 3, l0, l1, l1)


def test_a_negative_number_of_optimizer_states_is_refused():
    _, profile = two_layers_profile()
    with pytest.raises(ValueError, match="optimizer_states must be >= 0"):
        replace(profile, optimizer_states=-1.0)


def test_a_tied_parameter_is_held_once_by_every_rank_running_one_of_its_users():
    # embed owns the tied 400 bytes; head uses them too and owns a 40-byte bias
    embed = layer("embed", ["x"], sample_bytes=0, params=100)
    body = layer("body", ["embed"], sample_bytes=0)
    head = replace(layer("head", ["body"], sample_bytes=0, params=10), param_bytes=40)
    graph = LayerGraph(
        inputs=graph_of([embed]).inputs,
        layers=(embed, body, head),
        outputs=("head",),
        tied=(Tied("embed.weight", 400, ("embed", "head")),),
    )
    apart = {"embed": Placement(1), "body": Placement(2), "head": Placement(1, first=1)}
    both = {"embed": Placement(2), "body": Placement(2), "head": Placement(2)}
    held = memory.held_param_bytes
    assert held(graph, apart, 2) == [440, 440]
    assert held(graph, both, 2) == [440, 440]
    assert held(graph, {**both, "head": Placement(1)}, 2) == [440, 400]


def test_activations_follow_the_samples_each_rank_holds_at_a_narrow_width():
    graph = graph_of([layer("l0", ["x"], sample_bytes=100), layer("l1", ["l0"], sample_bytes=10)])
    # 5 samples: l0 on 2 of 3 ranks holds 3 and 2 (each with its copy of x, 4096 bytes a sample);
    # l1 on rank 0 holds all 5 (with its copy of l0's output)
    found = memory.activation_bytes(
        graph, {"l0": Placement(2), "l1": Placement(1)}, world_size=3, global_batch_size=5
    )
    assert found == [3 * (100 + 4096) + 5 * (10 + 100), 2 * (100 + 4096), 0]


def test_a_sample_split_by_height_keeps_the_rows_of_its_part():
    graph = graph_of([conv("c", ["x"], rows=8, channels=1)])  # 4 * 8 * 8 = 256 bytes a sample
    graph = replace(graph, layers=(replace(graph.layers[0], halo_bytes=0),))
    found = memory.activation_bytes(graph, {"c": Placement(2, 2)}, world_size=2, global_batch_size=4)
    # half the rows of each of its output and of its copy of x (4096 bytes a sample)
    assert found == [4 * (128 + 2048)] * 2


def test_a_part_split_by_height_also_keeps_the_halo_it_reads():
    # 1-channel 8x8 input (256 bytes a sample): a middle part would read two rows of halo (a quarter
    # of a sample); each of two parts reads one row from its one neighbour, into its copy of x
    graph = graph_of([conv("c", ["x"], rows=8, channels_in=1, channels=1)], input_bytes=256)
    found = memory.activation_bytes(graph, {"c": Placement(2, 2)}, world_size=2, global_batch_size=4)
    assert found == [4 * 256 * 0.5 + 4 * 256 * (0.5 + 0.125)] * 2


def test_the_summary_groups_ranks_alike_in_megabytes():
    assert memory.summary((48_100_000, 2_300_000, 2_300_000)) == "r0 48.1 MB, r1-2 2.3 MB"


def cost_two_layers() -> Plan:
    graph = two_layers(scale=1000)
    profile = linear_profile(graph, {"l0": (1e-3, 1e-4), "l1": (1e-3, 1e-4)}, max_batch=4)
    return plan_with_widths(graph, profile, {"l0": 2, "l1": 1}, **SIZES, amplification_limit=2.0)


def test_a_costed_plan_carries_the_estimate_and_prints_it_in_the_footer():
    plan = cost_two_layers()
    assert plan.memory_bytes == (19_240_000, 3_200_000)
    assert plan.table().splitlines()[-1] == (
        "memory per rank (params+grads+optimizer+activations, estimated): r0 19.2 MB, r1 3.2 MB"
    )


def test_the_estimate_round_trips_and_an_older_plan_without_it_loads_empty():
    plan = cost_two_layers()
    assert Plan.from_json(plan.to_json()) == plan
    older = plan.to_dict()
    del older["memory_bytes"]
    loaded = Plan.from_dict(older)
    assert loaded.memory_bytes == ()
    assert "memory per rank" not in loaded.table()
