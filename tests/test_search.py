"""Search: optimal against brute force, hard amplification limit, pins, memory budget, input errors."""

import dataclasses
import math
import random

import pytest

from lightning_deeppool.planner import cost
from lightning_deeppool.planner.graph import Tied
from lightning_deeppool.planner.search import amplification, candidate_widths, search

from planner_fixtures import (
    brute_force,
    chain,
    graph_of,
    layer,
    linear_profile,
    random_chain,
    random_dag,
    random_times,
)

INF = math.inf


def random_case(seed: int, make, max_layers: int, max_world: int):
    rng = random.Random(seed)
    world_size = rng.randint(2, max_world)
    batch = rng.randint(world_size, 4 * world_size)
    graph = make(rng, rng.randint(1, max_layers))
    return graph, linear_profile(graph, random_times(graph, rng), max_batch=batch), world_size, batch


def fastest_plan(graph, profile, world_size: int, batch: int):
    """The search with no amplification limit and no preference for full width: the fastest plan."""
    return search(
        graph,
        profile,
        world_size=world_size,
        global_batch_size=batch,
        amplification_limit=INF,
        min_gain=0,
        tie_tolerance=0,
    )


def test_candidates_are_every_width_in_small_worlds():
    assert candidate_widths(5, 7) == [1, 2, 3, 4, 5]


def test_candidates_in_large_worlds_are_the_smallest_width_per_batch_plus_the_world():
    widths = candidate_widths(100, 200)
    assert widths[:5] == [1, 2, 3, 4, 5]
    assert {cost.per_device_batch(200, w) for w in widths} == {
        cost.per_device_batch(200, w) for w in range(1, 101)
    }
    assert 100 in widths and 67 in widths and 68 not in widths  # ceil(200/67) == ceil(200/68) == 3


@pytest.mark.parametrize("seed", range(40))
def test_chains_are_exactly_optimal_against_brute_force(seed):
    graph, profile, world_size, batch = random_case(seed, random_chain, max_layers=5, max_world=5)
    plan = fastest_plan(graph, profile, world_size, batch)
    best, _ = brute_force(graph, profile, world_size=world_size, global_batch_size=batch)
    assert plan.predicted_step_time_s == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("seed", range(25))
def test_dags_with_residuals_and_joins_are_within_two_percent_of_brute_force(seed):
    graph, profile, world_size, batch = random_case(seed, random_dag, max_layers=8, max_world=4)
    plan = fastest_plan(graph, profile, world_size, batch)
    best, _ = brute_force(graph, profile, world_size=world_size, global_batch_size=batch)
    assert best * (1 - 1e-12) <= plan.predicted_step_time_s <= 1.02 * best
    assert plan.predicted_step_time_s == pytest.approx(best, rel=1e-9)  # no beam truncation at this size


@pytest.mark.parametrize("seed", range(15))
def test_with_an_amplification_limit_the_plan_is_optimal_among_allowed_widths(seed):
    graph, profile, world_size, batch = random_case(seed, random_dag, max_layers=6, max_world=4)
    sizes = dict(world_size=world_size, global_batch_size=batch)
    allowed = {
        item.name: [
            w
            for w in range(1, world_size + 1)
            if w == 1
            or cost.compute_time(profile, item, 1, batch) < 1e-4
            or amplification(profile, item, w, batch) <= 2.0
        ]
        for item in graph.layers
    }
    plan = search(graph, profile, **sizes)
    best, _ = brute_force(graph, profile, **sizes, allowed=allowed)
    assert plan.predicted_step_time_s == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("limit", [1.0, 1.5, 2.0, 4.0])
def test_amplification_limit_is_never_violated_by_any_layer(limit):
    for seed in range(10):
        graph, profile, world_size, batch = random_case(seed, random_dag, max_layers=8, max_world=6)
        plan = search(
            graph,
            profile,
            world_size=world_size,
            global_batch_size=batch,
            amplification_limit=limit,
            exempt_below_s=0,
        )
        for item in graph.layers:
            assert amplification(profile, item, plan.width(item.name), batch) <= limit, item.name


def test_layers_faster_than_the_exemption_threshold_may_exceed_the_limit():
    # Launch-bound layer (time flat in batch): spreading it is pure amplification, yet it avoids transfers.
    graph = chain(3, sample_bytes=1 << 20)
    profile = linear_profile(graph, {"l0": (1e-3, 1e-3), "l1": (50e-6, 0), "l2": (1e-3, 1e-3)}, max_batch=8)
    exempt = search(graph, profile, world_size=4, global_batch_size=8)
    strict = search(graph, profile, world_size=4, global_batch_size=8, exempt_below_s=0)
    assert exempt.widths() == {"l0": 4, "l1": 4, "l2": 4}
    assert strict.width("l1") == 2  # flat time: 2 devices spend exactly twice the device-time, the limit


def vgg_like():
    """Convolutions that scale with the batch, then a large linear head that barely does."""
    convs = [
        layer(f"features_{i}", ["x" if i == 0 else f"features_{i - 1}"], params=40_000) for i in range(4)
    ]
    head = layer("classifier", ["features_3"], sample_bytes=4000, params=13_000_000)
    graph = graph_of([*convs, head])
    times = {item.name: (20e-6, 100e-6) for item in convs} | {"classifier": (1.9e-3, 6e-6)}
    return graph, linear_profile(graph, times, max_batch=32)


def test_vgg_like_head_gets_fewer_devices_than_the_convolutions():
    graph, profile = vgg_like()
    convs = graph.layers[:-1]
    for world_size in (2, 4):
        for limit in (2.0, INF):
            plan = search(
                graph, profile, world_size=world_size, global_batch_size=32, amplification_limit=limit
            )
            assert plan.width("classifier") < min(plan.width(item.name) for item in convs)
            assert plan.width("features_0") == world_size
            assert plan.predicted_step_time_s < plan.predicted_ddp_step_time_s


def pinned_case():
    graph = graph_of(
        [
            layer("encoder_0", ["x"]),
            layer("encoder_1", ["encoder_0"]),
            layer("encoder_1_proj", ["encoder_1"]),
            layer("head", ["encoder_1_proj"], params=1_000_000),
        ]
    )
    profile = linear_profile(graph, {item.name: (1e-4, 1e-4) for item in graph.layers}, max_batch=8)
    return graph, profile


def test_pins_fix_the_width_of_every_layer_under_the_module_prefix():
    graph, profile = pinned_case()
    plan = search(graph, profile, world_size=4, global_batch_size=8, pins={"encoder": 3})
    assert [plan.width(f"encoder_{i}") for i in ("0", "1", "1_proj")] == [3, 3, 3]


def test_the_longest_matching_pin_wins_and_the_empty_prefix_pins_everything():
    graph, profile = pinned_case()
    plan = search(
        graph, profile, world_size=4, global_batch_size=8, pins={"": 1, "encoder": 2, "encoder.1": 4}
    )
    assert plan.widths() == {"encoder_0": 2, "encoder_1": 4, "encoder_1_proj": 4, "head": 1}


def test_a_pin_matches_whole_module_names_not_partial_ones():
    graph, profile = pinned_case()
    with pytest.raises(ValueError, match="pin 'encod' matches no layer"):
        search(graph, profile, world_size=4, global_batch_size=8, pins={"encod": 2})


def test_pinned_layers_are_not_held_to_the_amplification_limit():
    graph, _ = pinned_case()
    flat = linear_profile(graph, {item.name: (1e-3, 0) for item in graph.layers}, max_batch=8)
    assert search(graph, flat, world_size=4, global_batch_size=8, pins={"head": 4}).width("head") == 4
    assert amplification(flat, graph.layer("head"), 4, 8) == 4


def test_an_unknown_pin_is_an_error_listing_valid_module_names():
    graph, profile = pinned_case()
    with pytest.raises(
        ValueError, match=r"pin 'decoder' matches no layer; .* e.g. \['encoder.0', 'encoder.1'"
    ):
        search(graph, profile, world_size=4, global_batch_size=8, pins={"decoder": 2})


@pytest.mark.parametrize("width", [0, 5])
def test_a_pin_outside_one_to_the_world_size_is_an_error(width):
    graph, profile = pinned_case()
    with pytest.raises(ValueError, match=f"pin 'head': width {width} is outside 1..4"):
        search(graph, profile, world_size=4, global_batch_size=8, pins={"head": width})


def test_a_pin_may_use_a_width_outside_the_candidate_set():
    graph, _ = pinned_case()
    profile = linear_profile(graph, {item.name: (1e-4, 1e-4) for item in graph.layers}, max_batch=100)
    plan = search(graph, profile, world_size=100, global_batch_size=100, pins={"head": 67})
    assert 67 not in candidate_widths(100, 100)
    assert plan.width("head") == 67


def memory_case():
    # l1 barely scales and has many parameters, so one device is fastest; its activations are large.
    graph = graph_of(
        [
            layer("l0", ["x"], sample_bytes=1024),
            layer("l1", ["l0"], sample_bytes=1024, params=10_000_000),
            layer("l2", ["l1"], sample_bytes=1024),
        ],
        input_bytes=1024,
    )
    times = {"l0": (1e-4, 1e-4), "l1": (5e-3, 1e-6), "l2": (1e-4, 1e-4)}
    peaks = {"l0": 1 << 20, "l1": 1 << 24, "l2": 1 << 20}
    return graph, linear_profile(graph, times, max_batch=16, peak_bytes_per_sample=peaks)


def test_a_memory_budget_is_met_by_giving_up_speed():
    graph, profile = memory_case()
    sizes = dict(world_size=4, global_batch_size=16)
    free = search(graph, profile, **sizes, amplification_limit=INF)
    assert free.width("l1") == 1
    budget = 80e6 + 12 * (1 << 24)  # l1's parameters and gradients, and at most 12 of its samples
    fitted = search(graph, profile, **sizes, amplification_limit=INF, memory_budget_bytes=budget)
    assert max(cost.memory_per_rank(graph, profile, fitted.widths(), **sizes)) <= budget
    assert fitted.width("l1") >= 2
    assert fitted.predicted_step_time_s >= free.predicted_step_time_s


def test_an_impossible_memory_budget_is_an_error_naming_the_least_needed():
    graph, profile = memory_case()
    with pytest.raises(ValueError, match=r"even the plan with the least memory needs .* GiB on rank 0"):
        search(graph, profile, world_size=4, global_batch_size=16, memory_budget_bytes=1 << 20)


def test_a_memory_budget_without_profiled_memory_is_an_error():
    graph = chain(2)
    profile = linear_profile(graph, {"l0": (1e-3, 0), "l1": (1e-3, 0)}, max_batch=8)
    with pytest.raises(ValueError, match=r"a memory budget needs a profile with memory"):
        search(graph, profile, world_size=4, global_batch_size=8, memory_budget_bytes=1e9)


def test_a_batch_smaller_than_the_world_is_an_error():
    graph = chain(2)
    profile = linear_profile(graph, {"l0": (1e-3, 0), "l1": (1e-3, 0)}, max_batch=8)
    with pytest.raises(ValueError, match=r"global batch size 3 is smaller than the world size 4"):
        search(graph, profile, world_size=4, global_batch_size=3)


def test_a_beam_narrower_than_the_state_space_still_returns_a_valid_plan():
    graph, profile, world_size, batch = random_case(3, random_dag, max_layers=8, max_world=4)
    exact = fastest_plan(graph, profile, world_size, batch)
    beam = search(
        graph, profile, world_size=world_size, global_batch_size=batch, amplification_limit=INF, max_states=2
    )
    assert set(beam.widths()) == set(exact.widths())
    assert beam.predicted_step_time_s >= exact.predicted_step_time_s - 1e-12


def test_a_plan_gaining_less_than_min_gain_over_full_width_gives_way_to_it():
    graph, profile = vgg_like()
    sizes = dict(world_size=4, global_batch_size=32, amplification_limit=INF)
    burst = search(graph, profile, **sizes, min_gain=0, tie_tolerance=0)
    gain = 1 - burst.predicted_step_time_s / burst.predicted_ddp_step_time_s
    assert 0 < gain < 1 and set(burst.widths().values()) != {4}
    assert search(graph, profile, **sizes, min_gain=gain + 0.01).widths() == dict.fromkeys(burst.widths(), 4)
    assert search(graph, profile, **sizes, min_gain=gain - 0.01).widths() == burst.widths()


def test_a_plan_that_only_seems_to_save_a_shared_parameters_all_reduce_gives_way_to_full_width():
    # The embedding's weight is the head's too: at width 1 the embedding seems to skip the 4 MB
    # all-reduce, but the runtime reduces the weight among the head's devices all the same.
    layers = [
        layer("emb", ["x"], params=1_000_000),
        layer("body", ["emb"], params=1000),
        layer("head", ["body"], params=10),
    ]
    graph = dataclasses.replace(graph_of(layers), tied=(Tied("emb.weight", 4_000_000, ("emb", "head")),))
    times = {"emb": (1e-4, 1e-6), "body": (1e-4, 1e-3), "head": (1e-4, 1e-3)}
    plan = search(graph, linear_profile(graph, times, max_batch=8), world_size=2, global_batch_size=8)
    assert plan.widths() == {"emb": 2, "body": 2, "head": 2}
    assert plan.predicted_step_time_s == pytest.approx(plan.predicted_ddp_step_time_s)
