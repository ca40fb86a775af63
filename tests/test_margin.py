"""How sure a plan is: the best plan of another shape, the margin to it in the plan's footer, and the
layer profiles' spread that decides near ties for full width."""

import dataclasses
import math

import pytest

from lightning_deeppool.ir.placement import Placement
from lightning_deeppool.ir.profile import LayerProfile, Profile
from lightning_deeppool.planner import cost
from lightning_deeppool.planner.margin import describe, spread_between
from lightning_deeppool.planner.plan import Plan
from lightning_deeppool.planner.search import search

from planner_fixtures import chain, graph_of, layer, linear_profile

SIZES = dict(world_size=2, global_batch_size=8)


def heavy_head(spread_s: float) -> tuple:
    """``x -> body -> head``: a body that scales with the batch, a head of 1M parameters whose
    all-reduce (4 ms on the slow link) costs more than computing it on one device; every time
    measured with `spread_s` of spread."""
    graph = graph_of([layer("body", ["x"], params=100), layer("head", ["body"], params=1_000_000)])
    profile = linear_profile(graph, {"body": (1e-4, 1e-3), "head": (1e-3, 1e-5)}, max_batch=8)
    return graph, with_spread(profile, spread_s)


def with_spread(profile: Profile, spread_s: float) -> Profile:
    layers = {
        name: dataclasses.replace(item, spread=(spread_s,) * len(item.batch_sizes))
        for name, item in profile.layers.items()
    }
    return dataclasses.replace(profile, layers=layers)


def full_width_step(graph, profile) -> float:
    placements = {item.name: Placement(2) for item in graph.layers}
    return cost.evaluate(graph, profile, placements, **SIZES).total_s + profile.per_step_s


def test_a_burst_plan_is_compared_with_full_width_in_its_footer():
    graph, profile = heavy_head(spread_s=1e-5)
    plan = search(graph, profile, **SIZES)
    assert plan.widths() == {"body": 2, "head": 1}
    other = plan.alternative
    assert other.shape == "every layer at full width"
    assert other.step_time_s == pytest.approx(full_width_step(graph, profile))
    assert other.spread_s == pytest.approx(math.sqrt(2) * 1e-5)  # head at widths 1 and 2
    margin = other.step_time_s - plan.predicted_step_time_s
    footer = plan.table().splitlines()[-1]
    assert footer.startswith(
        f"margin +{margin * 1e3:.3f} ms ({other.step_time_s / plan.predicted_step_time_s:.2f}x)"
    )
    assert f"{margin / other.spread_s:.1f}x the layer profiles' spread" in footer
    assert "(0.014 ms)" in footer


def test_a_burst_plan_that_gains_no_more_than_the_spread_gives_way_to_full_width():
    graph, profile = heavy_head(spread_s=0.0)
    burst = search(graph, profile, **SIZES)
    gain = full_width_step(graph, profile) - burst.predicted_step_time_s
    plan = search(graph, with_spread(profile, gain), **SIZES)  # head at two widths: 1.41 times the gain
    assert plan.widths() == {"body": 2, "head": 2}
    assert plan.alternative.shape == "head at width 1"
    assert plan.alternative.step_time_s == pytest.approx(burst.predicted_step_time_s)
    footer = plan.table().splitlines()[-1]
    assert footer.startswith(f"margin -{gain * 1e3:.3f} ms")
    spread = f"spread over the layers they place differently ({math.sqrt(2) * gain * 1e3:.3f} ms)"
    assert footer.endswith(f"within the layer profiles' {spread}, so full width was kept")


def test_a_run_of_layers_widens_while_the_step_stays_within_the_spread_of_the_best():
    layers = [layer("c", ["x"]), layer("a", ["c"], params=150_000), layer("d", ["a"])]
    graph = graph_of([*layers, layer("h", ["d"], params=1_000_000)])
    times = {"c": (1e-4, 1e-3), "a": (1e-3, 1e-5), "d": (1e-4, 1e-3), "h": (1e-3, 1e-5)}
    profile = with_spread(linear_profile(graph, times, max_batch=8), 0.0)
    # a on one device saves its all-reduce, 0.4 ms (4%) more than its moves cost
    assert search(graph, profile, **SIZES).widths() == {"c": 2, "a": 1, "d": 2, "h": 1}
    noisy = dataclasses.replace(profile, layers={**profile.layers})
    noisy.layers["a"] = dataclasses.replace(profile.layers["a"], spread=(4e-4,) * 8)
    assert search(graph, noisy, **SIZES).widths() == {"c": 2, "a": 2, "d": 2, "h": 1}


def test_beside_a_plan_the_search_found_at_full_width_is_the_best_plan_with_one_layer_moved():
    # Every layer scales with the batch and has no parameters: full width is the fastest plan.
    graph = chain(3)
    profile = with_spread(
        linear_profile(graph, {f"l{i}": (1e-5, (i + 1) * 1e-3) for i in range(3)}, max_batch=8), 0.0
    )
    plan = search(graph, profile, **SIZES)
    assert plan.widths() == {"l0": 2, "l1": 2, "l2": 2}
    # Narrowing the cheapest layer, l0, costs the least.
    moved = {"l0": Placement(1), "l1": Placement(2), "l2": Placement(2)}
    assert plan.alternative.shape == "l0 at width 1"
    assert plan.alternative.step_time_s == pytest.approx(
        cost.evaluate(graph, profile, moved, **SIZES).total_s
    )
    assert plan.alternative.step_time_s > plan.predicted_step_time_s


def test_the_spread_between_two_plans_sums_each_differing_layer_at_both_placements():
    graph = chain(3)
    profile = linear_profile(graph, {f"l{i}": (1e-3, 0.0) for i in range(3)}, max_batch=8)
    spreads = {"l0": 1e-4, "l1": 2e-4, "l2": 4e-4}
    layers = {
        name: dataclasses.replace(item, spread=tuple(spreads[name] * b for b in item.batch_sizes))
        for name, item in profile.layers.items()
    }
    profile = dataclasses.replace(profile, layers=layers)
    wide = dict.fromkeys(spreads, Placement(2))
    narrow = {**wide, "l1": Placement(1)}
    # l1 at 4 samples (width 2) and at 8 (width 1), as independent errors
    assert spread_between(graph, profile, wide, narrow, 8) == pytest.approx(2e-4 * math.hypot(4, 8))
    assert spread_between(graph, profile, wide, wide, 8) == 0.0


def test_the_spread_is_unknown_where_a_differing_layer_has_none():
    graph = chain(2)
    profile = linear_profile(graph, {"l0": (1e-3, 0.0), "l1": (1e-3, 0.0)}, max_batch=8)
    wide = {"l0": Placement(2), "l1": Placement(2)}
    assert spread_between(graph, profile, wide, {**wide, "l1": Placement(1)}, 8) is None


def test_a_profile_without_spreads_says_so_in_the_footer():
    graph, profile = heavy_head(spread_s=0.0)
    bare = dataclasses.replace(
        profile, layers={n: dataclasses.replace(p, spread=None) for n, p in profile.layers.items()}
    )
    plan = search(graph, bare, **SIZES)
    assert plan.alternative.spread_s is None
    assert plan.table().splitlines()[-1].endswith("; the profile records no spread to judge it by")


def test_the_shape_names_the_runs_of_layers_off_full_width():
    graph = chain(4)
    placements = {"l0": Placement(4), "l1": Placement(1), "l2": Placement(1), "l3": Placement(4, 2)}
    assert describe(graph, placements, Placement(4)) == "l1..l2 at width 1, l3 at width 4 split in 2"
    assert (
        describe(graph, dict.fromkeys(placements, Placement(4)), Placement(4)) == "every layer at full width"
    )


def test_the_alternative_round_trips_through_the_plan_file():
    graph, profile = heavy_head(spread_s=1e-5)
    plan = search(graph, profile, **SIZES)
    assert Plan.from_json(plan.to_json()) == plan


def test_spreads_scale_with_the_layer_times_and_round_trip_through_the_profile_file():
    measured = LayerProfile("l0", (1, 2), (1e-3, 2e-3), spread=(1e-4, 3e-4))
    profile = Profile("fp", "cpu", "float32", {"l0": measured}, compute_scale=2.0)
    assert profile.layer("l0").spread == pytest.approx((2e-4, 6e-4))
    assert Profile.from_dict(profile.to_dict()) == profile


def test_a_spread_must_match_the_batch_sizes():
    with pytest.raises(ValueError, match=r"spread .* does not match batch_sizes"):
        LayerProfile("l0", (1, 2), (1e-3, 2e-3), spread=(1e-4,))
