"""Scaling projections: DDP and burst step times from the cost model, background fill of idle time."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from lightning_deeppool.ir.graph import GraphInput, LayerGraph
from lightning_deeppool.ir.placement import Placement
from lightning_deeppool.ir.profile import AlphaBeta, Profile
from lightning_deeppool.planner import cost, memory
from lightning_deeppool.planner.plan import plan_with_widths
from lightning_deeppool.planner.simulate import (
    assumptions,
    branch_summary,
    idle_device_seconds,
    parse_devices,
    project,
    table,
)

from planner_fixtures import SLOW_LINK, chain, conv_net, graph_of, layer, linear_profile

BATCH = 32
A100 = Path(__file__).parents[1] / "benchmarks" / "profiles" / "a100"


def conv_then_head():
    """A layer that scales with the batch, then a parameter-heavy one that barely does."""
    graph = graph_of(
        [layer("conv", ["x"], sample_bytes=256), layer("head", ["conv"], sample_bytes=64, params=4_000_000)]
    )
    profile = linear_profile(
        graph, {"conv": (10e-6, 100e-6), "head": (2e-3, 1e-6)}, max_batch=BATCH, comm=SLOW_LINK
    )
    return graph, profile


def test_ddp_step_time_is_the_ddp_baseline_at_every_device_count():
    graph, profile = conv_then_head()
    for p in project(graph, profile, devices=[1, 2, 4, 8], global_batch_size=BATCH):
        expected = cost.ddp_baseline(graph, profile, world_size=p.devices, global_batch_size=BATCH).total_s
        assert p.ddp_step_s == pytest.approx(expected, rel=1e-12)
        assert p.ddp_samples_per_s == pytest.approx(BATCH / expected)


def test_burst_without_an_amplification_limit_is_never_slower_than_ddp():
    graph, profile = conv_then_head()
    devices = [2, 4, 8, 16]
    for p in project(graph, profile, devices=devices, global_batch_size=BATCH, amplification_limit=math.inf):
        assert p.burst_step_s <= p.ddp_step_s * (1 + 1e-12)
    narrow = project(graph, profile, devices=[8], global_batch_size=BATCH)[0]
    assert narrow.plan.width("head") == 1
    assert narrow.burst_step_s < narrow.ddp_step_s


def test_background_fill_adds_idle_device_time_at_the_single_device_rate():
    graph, profile = conv_then_head()
    p = project(graph, profile, devices=[8], global_batch_size=BATCH, background_efficiency=0.5)[0]
    single = cost.evaluate(graph, profile, {"conv": 1, "head": 1}, world_size=1, global_batch_size=BATCH)
    compute = {item.name: item.compute_s for item in p.plan.layers}
    # Ranks 1..7 sit out the head's compute; ranks at or beyond the conv's width sit out the conv too.
    idle = 7 * compute["head"] + (8 - p.plan.width("conv")) * compute["conv"]
    assert p.idle_device_s == pytest.approx(idle)
    assert p.idle_fraction == pytest.approx(idle / (8 * p.burst_step_s))
    assert p.background_samples_per_s == pytest.approx(0.5 * idle / p.burst_step_s * BATCH / single.total_s)
    assert p.total_samples_per_s == pytest.approx(p.burst_samples_per_s + p.background_samples_per_s)


def test_a_plan_at_full_width_leaves_nothing_to_fill():
    graph = chain(2)
    profile = linear_profile(graph, {"l0": (0.0, 1e-3), "l1": (0.0, 1e-3)}, max_batch=BATCH)
    p = project(graph, profile, devices=[4], global_batch_size=BATCH)[0]
    assert p.plan.widths() == {"l0": 4, "l1": 4}
    assert idle_device_seconds(p.plan) == 0.0
    assert p.total_samples_per_s == p.burst_samples_per_s


def test_zero_efficiency_adds_no_background_throughput():
    graph, profile = conv_then_head()
    p = project(graph, profile, devices=[8], global_batch_size=BATCH, background_efficiency=0.0)[0]
    assert p.idle_fraction > 0.5
    assert p.total_samples_per_s == p.burst_samples_per_s


def test_more_devices_than_samples_is_an_error():
    graph, profile = conv_then_head()
    with pytest.raises(ValueError, match="global batch size 32 is smaller than the world size 64"):
        project(graph, profile, devices=[8, 64], global_batch_size=BATCH)


def test_efficiency_outside_zero_to_one_is_an_error():
    graph, profile = conv_then_head()
    with pytest.raises(ValueError, match=r"background efficiency must be in 0..1, got 1.5"):
        project(graph, profile, devices=[2], global_batch_size=BATCH, background_efficiency=1.5)


def test_a_profile_that_misses_small_per_device_batches_is_an_error():
    graph = chain(1)
    profile = linear_profile(graph, {"l0": (0.0, 1e-3)}, max_batch=BATCH)
    short = type(profile)(
        profile.graph_fingerprint,
        "synthetic",
        "float32",
        {"l0": type(profile.layers["l0"])("l0", (8, 16, 32), (1.0, 2.0, 4.0))},
    )
    with pytest.raises(ValueError, match=r"batch size 4 is outside the profiled range 8..32"):
        project(graph, short, devices=[8], global_batch_size=BATCH)


def test_table_has_a_row_per_device_count_and_the_gains():
    graph, profile = conv_then_head()
    lines = table(project(graph, profile, devices=[2, 8], global_batch_size=BATCH)).splitlines()
    assert lines[0].split()[:3] == ["devices", "DDP", "ms"]
    assert [line.split()[0] for line in lines[1:3]] == ["2", "8"]
    assert lines[2].endswith("x")
    assert lines[3].startswith("global batch 32; background fill at efficiency 0.4,")


def test_table_ends_with_each_burst_plans_estimated_memory_per_rank():
    graph, profile = conv_then_head()
    projections = project(graph, profile, devices=[2, 8], global_batch_size=BATCH)
    estimates = [
        memory.memory_per_rank(
            graph, p.plan.placements(), world_size=p.devices, global_batch_size=BATCH, profile=profile
        )
        for p in projections
    ]
    assert table(projections).splitlines()[-1] == (
        "memory per rank (params+grads+optimizer+activations, estimated): "
        f"2 devices: {memory.summary(estimates[0])}; 8 devices: {memory.summary(estimates[1])}"
    )


def test_the_assumptions_name_the_links_the_algorithm_and_what_is_left_out():
    graph, profile = conv_then_head()
    text = assumptions(profile, project(graph, profile, devices=[2, 32], global_batch_size=BATCH))
    assert "buckets of 25 MB; 2 devices: ring, 32 devices: ring" in text
    assert "point-to-point: 1 GB/s, 20 us per message" in text
    assert "gradient all-reduces after backward, not beside it" in text  # SLOW_LINK: no overlap
    assert "not modelled: contention between concurrent transfers" in text
    assert "no optimizer update (the profile has none)" in text
    overlapped = dataclasses.replace(profile, comm=dataclasses.replace(profile.comm, overlap=True))
    text = assumptions(overlapped, project(graph, overlapped, devices=[2], global_batch_size=BATCH))
    assert "gradient all-reduces beside backward: a bucket starts once its last layer's backward (67%" in text
    assert "compute beside them not slowed" in text
    assert all(line.startswith("assumes ") for line in text.splitlines())


def test_the_assumptions_state_the_contention_and_the_optimizer_update():
    graph, profile = conv_then_head()
    comm = dataclasses.replace(profile.comm, overlap=True, contention=0.25)
    profile = dataclasses.replace(profile, comm=comm, optimizer_s=2e-3)
    text = assumptions(profile, project(graph, profile, devices=[2], global_batch_size=BATCH))
    assert "; compute beside them at 75% of its speed" in text
    assert "assumes the optimizer update: 2.000 ms a step (the profile's), alike for every plan" in text


def test_device_lists_are_parsed_sorted_and_checked():
    assert parse_devices("16,8, 32,8") == [8, 16, 32]
    with pytest.raises(ValueError, match="comma-separated integers, got '8,x'"):
        parse_devices("8,x")
    with pytest.raises(ValueError, match="positive integers, got '0,8'"):
        parse_devices("0,8")


def test_more_devices_than_samples_are_projected_when_layers_can_be_split_by_height():
    graph = conv_net()
    times = {"conv0": (1e-3, 50e-3), "conv1": (1e-3, 50e-3), "conv2": (1e-3, 50e-3), "head": (1e-3, 1e-4)}
    profile = linear_profile(graph, times, max_batch=2, comm=SLOW_LINK)
    projections = project(graph, profile, devices=[1, 2, 4], global_batch_size=1)
    assert [p.plan.placements()["conv0"] for p in projections] == [
        Placement(1),
        Placement(2, 2),
        Placement(4, 4),
    ]
    assert projections[1].ddp_step_s == pytest.approx(
        projections[0].ddp_step_s
    )  # DDP: one sample, one device
    assert projections[2].burst_step_s < projections[1].burst_step_s < projections[0].burst_step_s


def test_table_and_assumptions_mention_splits_by_height_only_when_a_plan_has_them():
    graph = conv_net()
    times = {"conv0": (1e-3, 50e-3), "conv1": (1e-3, 50e-3), "conv2": (1e-3, 50e-3), "head": (1e-3, 1e-4)}
    profile = linear_profile(graph, times, max_batch=2, comm=SLOW_LINK)
    projections = project(graph, profile, devices=[1, 2, 4], global_batch_size=1)
    assert table(projections).splitlines()[-2] == (
        "split by height: 2 devices: 3 of 4 layers, 2 parts per sample; 4 devices: 3 of 4 layers, 4 parts "
        "per sample"
    )
    assert "assumes splits by height: a part's compute is the profiled time at its share" in assumptions(
        profile, projections
    )
    plain = project(*conv_then_head(), devices=[2], global_batch_size=BATCH)
    assert "split by height" not in table(plain) and "by height" not in assumptions(
        conv_then_head()[1], plain
    )


def a100(name: str, latency_s: float) -> tuple[LayerGraph, Profile]:
    """The original DeepPool's A100 layer profile of `name`, as this project ships it, at `latency_s`
    per message on its link's bandwidth."""
    data = json.loads((A100 / f"{name}.json").read_text())
    profile = Profile.from_dict(data)
    link = AlphaBeta(latency_s, profile.comm.link.seconds_per_byte)
    return LayerGraph.from_dict(data["graph"]), dataclasses.replace(
        profile, comm=dataclasses.replace(profile.comm, link=link)
    )


@pytest.mark.parametrize("latency_s", [5e-6, 40e-6])
def test_data_parallel_vgg16_on_8_a100s_is_deeppools_measured_step_within_10_percent(latency_s):
    # DeepPool measured 13.57 ms a step for data-parallel VGG16 on 8 A100s at global batch 32. 40 us
    # per message is DeepPool's own cost model's figure, 5 us nearer NCCL's on NVLink; the profile's
    # contention was fitted at 5 us, so 40 us checks it.
    graph, profile = a100("vgg16", latency_s)
    [projection] = project(graph, profile, devices=[8], global_batch_size=32)
    assert projection.ddp_step_s == pytest.approx(13.57e-3, rel=0.10)


@pytest.mark.parametrize("name", ["vgg16", "wrn101_2"])
def test_the_a100_optimizer_update_streams_parameters_and_gradients_at_hbm_bandwidth(name):
    # DeepPool's runtime steps plain SGD: it reads each parameter and its gradient and writes the
    # parameter, at the A100-SXM4-40GB's 1,555 GB/s.
    graph, profile = a100(name, 5e-6)
    param_bytes = sum(layer.param_bytes for layer in graph.layers)
    assert profile.optimizer_s == pytest.approx(3 * param_bytes / 1.555e12)
    [projection] = project(graph, profile, devices=[8], global_batch_size=32)
    ddp = cost.ddp_baseline(graph, profile, world_size=8, global_batch_size=32)
    assert projection.ddp_step_s == pytest.approx(ddp.total_s + profile.optimizer_s)


@pytest.mark.parametrize("name", ["vgg16", "wrn101_2"])
@pytest.mark.parametrize("latency_s", [5e-6, 40e-6])
def test_on_a100_profiles_the_plan_is_never_predicted_slower_than_data_parallelism(name, latency_s):
    graph, profile = a100(name, latency_s)
    devices = [8, 16, 32, 64, 128, 256]
    for projection in project(graph, profile, devices=devices, global_batch_size=256):
        assert projection.burst_step_s <= projection.ddp_step_s * (1 + 1e-12)


def test_the_projection_table_names_the_ranks_of_layers_run_side_by_side():
    graph = LayerGraph(
        (GraphInput("image", 256), GraphInput("text", 256)),
        (layer("img", ["image"]), layer("txt", ["text"]), layer("logits", ["img", "txt"], module=False)),
        ("logits",),
    )
    profile = linear_profile(graph, dict.fromkeys(("img", "txt", "logits"), (1e-3, 0.0)), max_batch=8)
    plan = plan_with_widths(
        graph,
        profile,
        {"img": 2, "txt": {"ranks": [2, 3]}, "logits": 4},
        world_size=4,
        global_batch_size=8,
        amplification_limit=2.0,
    )
    assert branch_summary(plan) == "1 of 3 layers off rank 0 (ranks 2-3)"
