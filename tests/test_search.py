"""Search: optimal against brute force, hard amplification limit, pins, memory budget, input errors."""

import dataclasses
import math
import random

import numpy as np
import pytest

from lightning_deeppool.ir.graph import Tied
from lightning_deeppool.ir.placement import Placement, per_device_batch
from lightning_deeppool.ir.profile import AlphaBeta, CommProfile, LayerProfile, Profile
from lightning_deeppool.planner import cost, memory
from lightning_deeppool.planner.plan import plan_with_widths
from lightning_deeppool.planner.search import (
    _memory,
    amplification,
    candidate_placements,
    candidate_widths,
    search,
    spatial_parts,
)

from planner_fixtures import (
    SLOW_LINK,
    brute_force,
    brute_force_placements,
    chain,
    conv,
    conv_net,
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
            if w in (1, min(world_size, batch))
            or cost.compute_time(profile, item, 1, batch) < 1e-4
            or amplification(profile, item, w, batch) <= 2.0
        ]
        for item in graph.layers
    }
    plan = search(graph, profile, **sizes)
    best, _ = brute_force(graph, profile, **sizes, allowed=allowed)
    assert plan.predicted_step_time_s == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("limit", [1.0, 1.5, 2.0, 4.0])
def test_amplification_limit_is_never_violated_by_any_layer_below_full_width(limit):
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
            width = plan.width(item.name)
            assert width == min(world_size, batch) or amplification(profile, item, width, batch) <= limit


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("limit", [1.0, 1.5, 2.0])
def test_the_plan_is_never_predicted_slower_than_full_width(limit, overlap):
    for seed in range(20):
        graph, profile, world_size, batch = random_case(seed, random_dag, max_layers=8, max_world=6)
        profile = dataclasses.replace(profile, comm=dataclasses.replace(profile.comm, overlap=overlap))
        sizes = dict(world_size=world_size, global_batch_size=batch, amplification_limit=limit)
        plan = search(graph, profile, **sizes, exempt_below_s=0)
        full = plan_with_widths(
            graph,
            profile,
            dict.fromkeys((item.name for item in graph.layers), min(world_size, batch)),
            **sizes,
        )
        assert plan.predicted_step_time_s <= full.predicted_step_time_s * (1 + 1e-12)


def test_data_parallelism_is_exempt_from_the_amplification_limit():
    # Every layer takes 4x as long per device at full width as alone (launch-bound), far over the limit,
    # but the full-width plan moves nothing: it is the fastest and must stay a candidate.
    graph = chain(3, sample_bytes=1 << 20)
    profile = linear_profile(
        graph, dict.fromkeys((item.name for item in graph.layers), (1e-3, 0.0)), max_batch=8
    )
    plan = search(graph, profile, world_size=4, global_batch_size=8, amplification_limit=2.0)
    assert set(plan.widths().values()) == {4}
    assert plan.limited == ("l0", "l1", "l2")


def test_the_plan_names_the_layers_the_limit_constrained():
    graph = chain(3, sample_bytes=1 << 20)
    profile = linear_profile(graph, {"l0": (1e-3, 1e-3), "l1": (1e-3, 0.0), "l2": (1e-3, 1e-3)}, max_batch=8)
    plan = search(graph, profile, world_size=4, global_batch_size=8, amplification_limit=2.0)
    assert plan.limited == ("l1",)
    assert "amplification limit 2 kept 1 layers from some widths: l1" in plan.table()
    assert type(plan).from_json(plan.to_json()).limited == ("l1",)


def test_layers_faster_than_the_exemption_threshold_may_exceed_the_limit():
    # Launch-bound layer (time flat in batch): spreading it is pure amplification, yet it avoids transfers.
    graph = chain(3, sample_bytes=1 << 20)
    profile = linear_profile(graph, {"l0": (1e-3, 1e-3), "l1": (50e-6, 0), "l2": (1e-3, 1e-3)}, max_batch=8)
    exempt = search(graph, profile, world_size=4, global_batch_size=8)
    strict = search(graph, profile, world_size=4, global_batch_size=8, exempt_below_s=0)
    assert exempt.widths() == {"l0": 4, "l1": 4, "l2": 4}
    assert exempt.limited == ()
    assert strict.limited == ("l1",)  # flat time: 3 devices spend three times the device-time


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


def test_pins_name_the_layers_of_a_compiled_submodule_as_the_user_wrote_them():
    graph = graph_of(
        [dataclasses.replace(layer("l0", ["x"]), target="body._orig_mod.0"), layer("head", ["l0"])]
    )
    profile = linear_profile(graph, {"l0": (1e-3, 1e-3), "head": (1e-3, 1e-3)}, max_batch=8)
    plan = search(graph, profile, world_size=4, global_batch_size=8, pins={"body.0": 1, "head": 2})
    assert plan.widths() == {"l0": 1, "head": 2}


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
    return graph, linear_profile(graph, times, max_batch=16, activation_bytes_per_sample=peaks)


def test_a_memory_budget_is_met_by_giving_up_speed():
    graph, profile = memory_case()
    sizes = dict(world_size=4, global_batch_size=16)
    free = search(graph, profile, **sizes, amplification_limit=INF)
    assert free.width("l1") == 1
    # l1's parameters with gradients and momentum, l0's and l2's samples, and at most 12 of l1's
    budget = 120e6 + 32 * (1 << 20) + 12 * (1 << 24)
    fitted = search(graph, profile, **sizes, amplification_limit=INF, memory_budget_bytes=budget)
    assert max(memory.memory_per_rank(graph, fitted.widths(), profile=profile, **sizes)) <= budget
    assert fitted.width("l1") >= 2
    assert fitted.predicted_step_time_s >= free.predicted_step_time_s


def test_an_impossible_memory_budget_is_an_error_naming_the_least_needed():
    graph, profile = memory_case()
    with pytest.raises(
        ValueError, match=r"even the plan with the least memory needs [0-9,]+ bytes on rank 0"
    ):
        search(graph, profile, world_size=4, global_batch_size=16, memory_budget_bytes=1 << 20)


def test_a_memory_budget_counts_each_layers_output_where_no_activations_were_profiled():
    # as memory_case, on a CPU-like profile: l1 keeps its 16 MiB output a sample, 4 times its input
    graph = graph_of(
        [
            layer("l0", ["x"], sample_bytes=1 << 20),
            layer("l1", ["l0"], sample_bytes=1 << 24, params=10_000_000),
            layer("l2", ["l1"], sample_bytes=1 << 20),
        ],
        input_bytes=1024,
    )
    times = {"l0": (1e-4, 1e-4), "l1": (5e-3, 1e-6), "l2": (1e-4, 1e-4)}
    profile = linear_profile(graph, times, max_batch=16)
    sizes = dict(world_size=4, global_batch_size=16)
    assert search(graph, profile, **sizes, amplification_limit=INF).width("l1") == 1
    budget = 120e6 + 32 * (1 << 20) + 12 * (1 << 24)
    fitted = search(graph, profile, **sizes, amplification_limit=INF, memory_budget_bytes=budget)
    assert max(memory.memory_per_rank(graph, fitted.widths(), profile=profile, **sizes)) <= budget
    assert fitted.width("l1") >= 2


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


# ---------------------------------------------------------------------------- spatial splits
CONV_TIMES = {"conv0": (1e-3, 50e-3), "conv1": (1e-3, 50e-3), "conv2": (1e-3, 50e-3), "head": (1e-3, 1e-4)}
FAST_LINK = CommProfile(link=AlphaBeta(latency_s=5e-6, seconds_per_byte=1e-11))


def test_candidate_placements_add_spatial_splits_only_where_a_part_computes_less_than_any_width():
    assert spatial_parts(64) == [2, 3, 4, 8, 16, 32, 64]
    assert candidate_placements(2, 1) == [Placement(1), Placement(2, 2)]
    # batch 2 on 4 devices: widths up to 2, then 2 groups of 2 parts, or 1 group of 3 or 4 parts.
    assert candidate_placements(4, 2) == [
        Placement(1),
        Placement(2),
        Placement(4, 2),
        Placement(3, 3),
        Placement(4, 4),
    ]
    assert candidate_placements(4, 8) == [Placement(w) for w in range(1, 5)]  # 2 samples per device at best


def test_at_global_batch_one_the_convolutions_are_split_by_height_and_the_head_runs_on_one_device():
    graph = conv_net()
    profile = linear_profile(graph, CONV_TIMES, max_batch=2)
    plan = search(graph, profile, world_size=2, global_batch_size=1)
    assert plan.placements() == {
        "conv0": Placement(2, 2),
        "conv1": Placement(2, 2),
        "conv2": Placement(2, 2),
        "head": Placement(1),
    }
    assert plan.predicted_step_time_s < 0.7 * plan.predicted_ddp_step_time_s  # DDP: one device


def test_with_a_sample_per_device_and_cheap_transfers_plain_data_parallelism_wins():
    graph = conv_net()
    profile = linear_profile(graph, CONV_TIMES, max_batch=2, comm=FAST_LINK)
    plan = search(graph, profile, world_size=2, global_batch_size=2)
    assert all(placement == Placement(2) for placement in plan.placements().values())
    split = {**plan.placements(), **dict.fromkeys(("conv0", "conv1", "conv2"), Placement(2, 2))}
    slower = cost.evaluate(graph, profile, split, world_size=2, global_batch_size=2).total_s
    assert plan.predicted_step_time_s < slower


def test_with_fewer_samples_than_devices_no_layer_has_more_sample_groups_than_samples():
    graph = conv_net()
    profile = linear_profile(graph, CONV_TIMES, max_batch=3, comm=FAST_LINK)
    plan = search(graph, profile, world_size=4, global_batch_size=3, amplification_limit=INF)
    assert all(placement.groups <= 3 for placement in plan.placements().values())
    assert plan.width("head") <= 3
    assert plan.placements()["conv0"].spatial > 1


def test_a_batch_smaller_than_the_world_is_an_error_when_no_layer_can_be_split():
    graph = chain(2)
    profile = linear_profile(graph, {"l0": (1e-3, 0), "l1": (1e-3, 0)}, max_batch=8)
    with pytest.raises(ValueError, match=r"smaller than the world size 4; no layer can be split by height"):
        search(graph, profile, world_size=4, global_batch_size=3)


def test_a_layer_is_split_in_no_more_parts_than_it_has_rows():
    pointwise = [dataclasses.replace(item, height=2, halo_bytes=0) for item in conv_net().layers[:3]]
    graph = graph_of([*pointwise, conv_net().layers[3]], input_bytes=4 * 3 * 512 * 512)
    profile = linear_profile(graph, CONV_TIMES, max_batch=1, comm=FAST_LINK)
    plan = search(graph, profile, world_size=4, global_batch_size=1, amplification_limit=INF)
    assert plan.placements()["conv0"] == Placement(2, 2)


def residual_convs(rng: random.Random, rows: int):
    """x -> conv0 -> conv1 -> add(conv1, conv0) -> head: two live values across the block."""
    add = dataclasses.replace(
        layer("add", ["conv1", "conv0"], sample_bytes=4 * 16 * rows * rows, module=False), height=rows
    )
    convs = [conv("conv0", ["x"], rows=rows, channels_in=3), conv("conv1", ["conv0"], rows=rows)]
    return graph_of([*convs, add, layer("head", ["add"], params=rng.choice([0, 100_000]))])


@pytest.mark.parametrize("seed", range(16))
def test_spatial_plans_are_exactly_optimal_against_enumerating_every_candidate_placement(seed):
    rng = random.Random(seed)
    world_size = rng.randint(2, 4)
    batch = rng.randint(1, world_size + 1)
    rows = rng.choice([2, 3, 16])
    if seed % 2:
        graph = residual_convs(rng, rows)
    else:
        n = rng.randint(1, 3)
        layers = [conv(f"conv{i}", ["x" if i == 0 else f"conv{i - 1}"], rows=rows) for i in range(n)]
        graph = graph_of([*layers, layer("head", [layers[-1].name], params=rng.choice([0, 100_000]))])
    times = {item.name: (rng.uniform(1e-5, 1e-3), rng.uniform(1e-5, 1e-2)) for item in graph.layers}
    profile = linear_profile(graph, times, max_batch=batch + 1)
    if seed % 4 >= 2:  # the spatial layers' messages on links of their own, priced apart
        halo = AlphaBeta(rng.uniform(1e-6, 1e-4), rng.uniform(1e-11, 1e-9))
        profile = dataclasses.replace(profile, comm=dataclasses.replace(profile.comm, halo=halo))
    options = {
        item.name: [
            p for p in candidate_placements(world_size, batch) if p.spatial == 1 or p.spatial <= item.height
        ]
        for item in graph.layers
    }
    plan = fastest_plan(graph, profile, world_size, batch)
    best = brute_force_placements(
        graph, profile, world_size=world_size, global_batch_size=batch, options=options
    )
    assert plan.predicted_step_time_s == pytest.approx(best, rel=1e-9)


def test_the_amplification_limit_holds_at_spatial_placements():
    graph = conv_net()
    times = {**CONV_TIMES, "conv1": (40e-3, 10e-3)}  # mostly fixed cost: splitting it only spends devices
    profile = linear_profile(graph, times, max_batch=2, comm=FAST_LINK)
    plan = search(graph, profile, world_size=4, global_batch_size=1, exempt_below_s=0)
    for item in graph.layers:
        placement = plan.placements()[item.name]
        assert amplification(profile, item, placement, 1, halo=cost.halo_share(graph, item)) <= 2.0
    # Four quarters of conv1 would take 42.5 ms each, over twice its 50 ms alone: two halves at most.
    assert plan.width("conv1") <= 2
    assert plan.placements()["conv0"] == Placement(4, 4)


def test_a_memory_budget_can_make_a_spatial_split_necessary():
    graph = conv_net()
    # A slow link: splitting does not pay for itself, but halves each device's activations.
    slow = CommProfile(link=AlphaBeta(latency_s=1e-3, seconds_per_byte=1e-8))
    peaks = dict.fromkeys(("conv0", "conv1", "conv2"), 1 << 30) | {"head": 1 << 20}
    profile = linear_profile(graph, CONV_TIMES, max_batch=2, comm=slow, activation_bytes_per_sample=peaks)
    sizes = dict(world_size=2, global_batch_size=1)
    free = search(graph, profile, **sizes)
    assert set(free.placements().values()) == {Placement(1)}
    budget = 2.5 * (1 << 30)  # three convolutions whole need 3 GiB
    fitted = search(graph, profile, **sizes, memory_budget_bytes=budget)
    assert max(memory.memory_per_rank(graph, fitted.placements(), profile=profile, **sizes)) <= budget
    assert any(placement.spatial == 2 for placement in fitted.placements().values())


def test_vectorized_memory_sums_to_the_memory_models_rank_zero_without_input_copies():
    graph = conv_net(2, rows=6)
    sizes = (1, 3, 8)  # sparse and uneven, so that both interpolate
    none_kept = (0, 0, 0)  # no layer keeps its input: the copies placements make cost nothing here
    measured = {
        "conv0": LayerProfile("conv0", sizes, (1e-3, 2e-3, 5e-3), (1000, 2500, 9000), None, none_kept),
        "conv1": LayerProfile("conv1", sizes, (1e-3, 2e-3, 5e-3), (700, 4000, 4100), None, none_kept),
        # activations not profiled: its output's bytes
        "head": LayerProfile("head", sizes, (1e-4, 2e-4, 3e-4), None, None, none_kept),
    }
    profile = Profile(graph.fingerprint, "synthetic", "float32", measured, SLOW_LINK, optimizer_states=2.0)
    world_size, batch = 8, 8
    for width in (1, 2, 4, 8):
        for spatial in (s for s in (1, 2) if width % s == 0):
            placements = {"conv0": Placement(width, spatial), "conv1": Placement(width, spatial)}
            placements["head"] = Placement(width)
            found = sum(
                float(
                    _memory(
                        profile,
                        item,
                        np.array([per_device_batch(batch, placements[item.name].groups)]),
                        np.array([placements[item.name].spatial]),
                        cost.halo_share(graph, item),
                    )[0]
                )
                for item in graph.layers
            )
            reference = memory.memory_per_rank(
                graph, placements, world_size=world_size, global_batch_size=batch, profile=profile
            )[0]
            assert found == pytest.approx(reference, abs=len(graph.layers))


def test_a_memory_budget_counts_the_copies_a_plan_makes_of_values_moved_between_placements():
    graph, profile = memory_case()  # no saved inputs profiled: every copy is kept
    sizes = dict(world_size=4, global_batch_size=16)
    budget = 120e6 + 32 * (1 << 20) + 12 * (1 << 24)
    fitted = search(graph, profile, **sizes, amplification_limit=INF, memory_budget_bytes=budget)
    whole = memory.memory_per_rank(graph, fitted.widths(), profile=profile, **sizes)
    assert max(whole) <= budget
    assert fitted.memory_bytes == whole


def test_a_pin_may_split_samples_by_height_as_a_mapping_or_a_placement():
    graph = conv_net()
    profile = linear_profile(graph, CONV_TIMES, max_batch=4)
    pins = {"conv0": {"width": 4, "spatial": 2}, "conv1": Placement(4, 4), "head": 1}
    plan = search(graph, profile, world_size=4, global_batch_size=2, pins=pins)
    assert plan.placements()["conv0"] == Placement(4, 2)
    assert plan.placements()["conv1"] == Placement(4, 4)
    assert plan.placements()["head"] == Placement(1)


@pytest.mark.parametrize(
    ("pin", "message"),
    [
        ({"head": {"width": 2, "spatial": 2}}, r"pin 'head': layer 'head' cannot be split by height"),
        (
            {"conv0": {"width": 4, "spatial": 3}},
            r"pin 'conv0': layer 'conv0': spatial 3 does not divide width 4",
        ),
        ({"conv0": {"width": 4, "parts": 2}}, r"pin 'conv0': .* unknown keys \['parts'\]"),
        (
            {"": 4},
            r"pin '': layer 'conv0': width 4 at spatial 1 makes 4 sample groups but the global batch has 2",
        ),
        ({"conv0": {"width": 8, "spatial": 2}}, r"pin 'conv0': width 8 is outside 1..4"),
    ],
)
def test_a_pin_the_layers_cannot_run_at_is_an_error_naming_pin_and_layer(pin, message):
    graph = conv_net()
    profile = linear_profile(graph, CONV_TIMES, max_batch=4)
    with pytest.raises(ValueError, match=message):
        search(graph, profile, world_size=4, global_batch_size=2, pins=pin)
