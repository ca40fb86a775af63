"""Plan files: exact JSON round trips, version and mismatch errors, validation, the summary table."""

import json
import math
from dataclasses import replace

import pytest

from lightning_deeppool.ir.placement import Placement, equal_width_runs
from lightning_deeppool.planner.plan import PLAN_VERSION, Plan, plan_with_widths, validate_plan

from planner_fixtures import chain, conv_net, linear_profile

pytestmark = pytest.mark.floors

SIZES = dict(world_size=4, global_batch_size=8)


def make_plan(widths=None, limit=2.0, graph=None):
    graph = graph or chain(3, params=1000)
    profile = linear_profile(graph, {item.name: (1e-3, 1e-4) for item in graph.layers}, max_batch=8)
    widths = widths or {"l0": 4, "l1": 1, "l2": 2}
    return plan_with_widths(graph, profile, widths, **SIZES, amplification_limit=limit), graph


def test_plan_records_widths_costs_and_both_predictions():
    plan, _ = make_plan()
    assert plan.version == PLAN_VERSION
    assert plan.widths() == {"l0": 4, "l1": 1, "l2": 2}
    assert plan.layers[1].compute_s == pytest.approx(1e-3 + 8 * 1e-4)
    assert plan.layers[1].sync_s == 0.0
    assert plan.layers[0].params == 1000
    assert plan.layers[0].module == "l0"
    assert plan.predicted_step_time_s == pytest.approx(
        sum(item.compute_s + item.sync_s + item.transfer_s for item in plan.layers)
    )
    assert plan.predicted_ddp_step_time_s > 0


def test_the_ranks_wait_is_paid_once_a_step_by_the_plan_and_by_ddp():
    graph = chain(3, params=1000)
    profile = linear_profile(graph, {item.name: (1e-3, 1e-4) for item in graph.layers}, max_batch=8)
    waiting = replace(profile, comm=replace(profile.comm, sync_wait_s=2e-3))
    widths = {"l0": 4, "l1": 1, "l2": 2}
    plain = plan_with_widths(graph, profile, widths, **SIZES, amplification_limit=2.0)
    plan = plan_with_widths(graph, waiting, widths, **SIZES, amplification_limit=2.0)
    assert plan.predicted_step_time_s == pytest.approx(plain.predicted_step_time_s + 2e-3)
    assert plan.predicted_ddp_step_time_s == pytest.approx(plain.predicted_ddp_step_time_s + 2e-3)
    assert "the ranks' wait for each other, 2.000 ms" in plan.table()
    assert Plan.from_json(plan.to_json()) == plan


def test_json_round_trip_is_exact():
    plan, _ = make_plan()
    assert Plan.from_json(plan.to_json()) == plan


def test_an_infinite_amplification_limit_round_trips_as_the_string_inf():
    plan, _ = make_plan(limit=math.inf)
    text = plan.to_json()
    assert json.loads(text)["amplification_limit"] == "inf"
    assert Plan.from_json(text) == plan
    assert math.isinf(Plan.from_json(text).amplification_limit)


def test_json_has_the_documented_keys():
    plan, _ = make_plan()
    data = json.loads(plan.to_json())
    assert set(data) == {
        "version",
        "world_size",
        "global_batch_size",
        "optimizer_s",
        "sync_wait_s",
        "amplification_limit",
        "predicted_step_time_s",
        "predicted_ddp_step_time_s",
        "graph_fingerprint",
        "limited",
        "hidden_sync_s",
        "memory_bytes",
        "layers",
    }
    assert set(data["layers"][0]) == {
        "name",
        "module",
        "width",
        "compute_s",
        "sync_s",
        "transfer_s",
        "params",
        "spatial",
    }


def test_save_and_load_round_trip(tmp_path):
    plan, _ = make_plan()
    plan.save(tmp_path / "plans" / "plan.json")
    assert Plan.load(tmp_path / "plans" / "plan.json") == plan


def test_a_plan_of_another_version_fails_to_load():
    plan, _ = make_plan()
    data = plan.to_dict() | {"version": PLAN_VERSION + 1}
    with pytest.raises(ValueError, match=f"plan version {PLAN_VERSION + 1} is not supported .* plan again"):
        Plan.from_dict(data)


def test_width_of_an_unknown_layer_is_a_key_error_listing_the_layers():
    plan, _ = make_plan()
    with pytest.raises(KeyError, match=r"layer 'fc' is not in the plan \(layers: l0, l1, l2\)"):
        plan.width("fc")


def test_check_matches_accepts_the_same_graph_and_world():
    plan, graph = make_plan()
    plan.check_matches(graph, 4)


def test_check_matches_names_a_different_graph_and_its_layers():
    plan, _ = make_plan()
    with pytest.raises(ValueError, match=r"different graph .* layers missing from the plan: \['l3'\]"):
        plan.check_matches(chain(4, params=1000), 4)


def test_check_matches_notices_same_names_but_other_sizes():
    plan, _ = make_plan()
    with pytest.raises(
        ValueError, match=r"different graph .* the layer names match but the structure or sizes"
    ):
        plan.check_matches(chain(3, params=2000), 4)


def test_a_graph_at_other_per_sample_sizes_keeps_its_structure_but_not_its_fingerprint():
    short, long = chain(3, params=1000, sample_bytes=64), chain(3, params=1000, sample_bytes=96)
    assert short.structure == long.structure
    assert short.fingerprint != long.fingerprint


def test_other_layers_or_parameters_change_the_structure():
    graph = chain(3, params=1000)
    assert chain(4, params=1000).structure != graph.structure
    assert chain(3, params=2000).structure != graph.structure


def test_check_matches_names_a_different_world_size():
    plan, graph = make_plan()
    with pytest.raises(ValueError, match=r"made for world size 4, but the world size is 8; plan again"):
        plan.check_matches(graph, 8)


def test_validate_plan_names_a_layer_without_a_width():
    plan, _ = make_plan()
    with pytest.raises(ValueError, match=r"layer 'l3' has no width in the plan"):
        validate_plan(plan, chain(4, params=1000))


def test_validate_plan_names_a_layer_with_a_width_outside_the_world():
    plan, graph = make_plan()
    broken = replace(plan, layers=(replace(plan.layers[0], width=5), *plan.layers[1:]))
    with pytest.raises(ValueError, match=r"layer 'l0' has width 5, outside 1..4"):
        validate_plan(broken, graph)


def test_costing_an_assignment_that_misses_a_layer_is_an_error():
    graph = chain(2)
    profile = linear_profile(graph, {"l0": (1e-3, 0), "l1": (1e-3, 0)}, max_batch=8)
    with pytest.raises(ValueError, match=r"layer 'l1' has no width"):
        plan_with_widths(graph, profile, {"l0": 1}, **SIZES, amplification_limit=2.0)


def test_idle_fraction_is_the_share_of_compute_time_a_rank_runs_no_layer():
    plan, _ = make_plan(widths={"l0": 4, "l1": 1, "l2": 1})
    l0, rest = plan.layers[0].compute_s, plan.layers[1].compute_s + plan.layers[2].compute_s
    idle = rest / (l0 + rest)
    assert plan.idle_fractions() == pytest.approx([0.0, idle, idle, idle])


def test_table_lists_every_layer_and_summarizes_speedup_and_idle_ranks():
    plan, _ = make_plan(widths={"l0": 4, "l1": 1, "l2": 1})
    lines = plan.table().splitlines()
    assert lines[0].split() == [
        "layer",
        "module",
        "width",
        "compute",
        "ms",
        "sync",
        "ms",
        "transfer",
        "ms",
        "params",
    ]
    assert lines[2].split()[:3] == ["l1", "l1", "1"]
    assert lines[2].split()[3] == f"{plan.layers[1].compute_s * 1e3:.3f}"
    assert f"speedup {plan.speedup:.2f}x" in lines[-3]
    assert lines[-2].startswith("idle fraction per rank: r0 0%, r1-3 ")
    assert lines[-1].startswith("memory per rank (params+grads+optimizer+activations, estimated): r0 ")
    assert len({len(line) for line in lines[:4]}) == 1  # aligned columns


def test_equal_width_runs_cut_only_where_the_width_changes():
    widths = {"a": 2, "b": 2, "c": 1, "d": 2}

    assert equal_width_runs(["a", "b", "c", "d"], widths) == [["a", "b"], ["c"], ["d"]]


def spatial_plan(global_batch_size=2, world_size=4):
    """Two convolutions split by height on 4 devices, a head on one."""
    graph = conv_net(2, rows=8)
    profile = linear_profile(graph, {item.name: (1e-3, 1e-4) for item in graph.layers}, max_batch=8)
    placements = {"conv0": Placement(4, 2), "conv1": {"width": 4, "spatial": 4}, "head": 1}
    plan = plan_with_widths(
        graph,
        profile,
        placements,
        world_size=world_size,
        global_batch_size=global_batch_size,
        amplification_limit=2.0,
    )
    return plan, graph


def test_a_plan_records_each_layers_placement_from_an_int_a_placement_or_a_mapping():
    plan, _ = spatial_plan()
    assert plan.placements() == {"conv0": Placement(4, 2), "conv1": Placement(4, 4), "head": Placement(1)}
    assert plan.widths() == {"conv0": 4, "conv1": 4, "head": 1}
    assert [layer.spatial for layer in plan.layers] == [2, 4, 1]


def test_json_writes_spatial_for_every_layer_and_round_trips_a_spatial_plan():
    plan, _ = spatial_plan()
    data = json.loads(plan.to_json())
    assert [layer["spatial"] for layer in data["layers"]] == [2, 4, 1]
    assert data["version"] == PLAN_VERSION == 1
    assert Plan.from_json(plan.to_json()) == plan
    unsplit, _ = make_plan()
    assert [layer["spatial"] for layer in json.loads(unsplit.to_json())["layers"]] == [1, 1, 1]


def test_a_plan_written_before_spatial_splits_loads_with_spatial_one():
    plan, _ = make_plan()
    data = plan.to_dict()
    for layer in data["layers"]:
        del layer["spatial"]
    loaded = Plan.from_dict(data)
    assert loaded == plan
    assert set(loaded.placements().values()) == {Placement(4), Placement(1), Placement(2)}


def test_the_table_has_a_spatial_column_only_when_a_layer_is_split():
    plan, _ = spatial_plan()
    lines = plan.table().splitlines()
    assert lines[0].split()[:5] == ["layer", "module", "width", "spatial", "compute"]
    assert [line.split()[2:4] for line in lines[1:4]] == [["4", "2"], ["4", "4"], ["1", "1"]]
    assert len({len(line) for line in lines[:4]}) == 1
    assert "spatial" not in make_plan()[0].table()


@pytest.mark.parametrize(
    ("layer", "placement", "message"),
    [
        ("conv0", (4, 3), r"layer 'conv0': spatial 3 does not divide width 4; split each sample in a number"),
        (
            "head",
            (2, 2),
            r"layer 'head' cannot be split by height \(spatial 2\): only convolutions, .* give it spatial 1",
        ),
    ],
)
def test_validate_plan_names_a_layer_whose_spatial_split_is_not_allowed(layer, placement, message):
    plan, graph = spatial_plan()
    broken = replace(
        plan,
        layers=tuple(
            replace(item, width=placement[0], spatial=placement[1]) if item.name == layer else item
            for item in plan.layers
        ),
    )
    with pytest.raises(ValueError, match=message):
        validate_plan(broken, graph)


def test_validate_plan_accepts_a_plan_with_spatial_splits():
    plan, graph = spatial_plan()
    validate_plan(plan, graph)


def test_validate_plan_refuses_more_parts_than_the_layer_has_rows():
    plan, _ = spatial_plan()
    graph = conv_net(2, rows=3)
    with pytest.raises(
        ValueError, match=r"layer 'conv1': spatial 4 is more parts than its 3 rows; use at most"
    ):
        validate_plan(replace(plan, graph_fingerprint=graph.fingerprint), graph)


def test_validate_plan_refuses_more_sample_groups_than_samples():
    plan, graph = spatial_plan(global_batch_size=2)
    broken = replace(plan, layers=(replace(plan.layers[0], spatial=1), *plan.layers[1:]))
    with pytest.raises(
        ValueError,
        match=r"layer 'conv0': width 4 at spatial 1 makes 4 sample groups but the global batch has 2 "
        r"samples; use at most 2 groups \(width <= 2 at spatial 1\), or split each sample in more parts",
    ):
        validate_plan(broken, graph)


def test_costing_a_placement_a_layer_cannot_run_at_is_an_error_naming_it():
    graph = conv_net(2, rows=8)
    profile = linear_profile(graph, {item.name: (1e-3, 1e-4) for item in graph.layers}, max_batch=8)
    with pytest.raises(ValueError, match=r"layer 'head' cannot be split by height \(spatial 2\)"):
        plan_with_widths(
            graph,
            profile,
            {"conv0": 4, "conv1": 4, "head": Placement(2, 2)},
            **SIZES,
            amplification_limit=2.0,
        )


def test_a_placement_mapping_with_unknown_keys_is_an_error_showing_the_expected_form():
    graph = conv_net(2, rows=8)
    profile = linear_profile(graph, {item.name: (1e-3, 1e-4) for item in graph.layers}, max_batch=8)
    with pytest.raises(
        ValueError,
        match=r"layer 'conv0': \{'width': 4, 'parts': 2\} has unknown keys \['parts'\]; .*'spatial': 2",
    ):
        plan_with_widths(
            graph,
            profile,
            {"conv0": {"width": 4, "parts": 2}, "conv1": 4, "head": 1},
            **SIZES,
            amplification_limit=2.0,
        )


def test_a_batch_smaller_than_the_world_plans_when_the_wide_layers_are_split_by_height():
    graph = conv_net(2, rows=8)
    profile = linear_profile(graph, {item.name: (1e-3, 1e-4) for item in graph.layers}, max_batch=8)
    plan = plan_with_widths(
        graph,
        profile,
        {"conv0": Placement(4, 4), "conv1": Placement(2, 2), "head": 1},
        world_size=4,
        global_batch_size=1,
        amplification_limit=2.0,
    )
    assert plan.placements()["conv0"] == Placement(4, 4)
    # Data parallelism cannot use more devices than samples: its baseline runs on one device, where
    # the input already is (rank 0 holds the only sample), so it pays compute alone.
    assert plan.predicted_ddp_step_time_s == pytest.approx(3 * (1e-3 + 1e-4))
