"""The cost model: compute at ceil(B / w), sync among the layer's devices, transfers on width changes."""

import dataclasses
import itertools

import numpy as np
import pytest

from lightning_deeppool.ir.graph import Layer, LayerGraph, Tied
from lightning_deeppool.ir.placement import (
    Layout,
    Placement,
    balanced,
    busiest_rank_samples,
    busiest_rank_share,
)
from lightning_deeppool.ir.profile import AlphaBeta, CommProfile, LayerProfile, Profile
from lightning_deeppool.planner import checks, cost

from planner_fixtures import SLOW_LINK, chain, graph_of, layer, linear_profile

SIZES = dict(world_size=4, global_batch_size=10)


def test_compute_uses_the_busiest_devices_batch_ceil_b_over_w():
    graph = chain(1)
    profile = linear_profile(graph, {"l0": (1e-3, 1e-4)}, max_batch=10)
    assert cost.compute_time(profile, graph.layers[0], 3, 10) == pytest.approx(1e-3 + 4 * 1e-4)
    assert cost.compute_time(profile, graph.layers[0], 1, 10) == pytest.approx(1e-3 + 10 * 1e-4)


def test_compute_outside_the_profiled_batches_raises_instead_of_extrapolating():
    graph = chain(1)
    profile = linear_profile(graph, {"l0": (1e-3, 1e-4)}, max_batch=8)
    with pytest.raises(ValueError, match=r"batch size 10 is outside the profiled range 1..8"):
        cost.compute_time(profile, graph.layers[0], 1, 10)


def test_compute_reads_times_fitted_to_grow_with_the_batch():
    graph = chain(1)
    measured = LayerProfile("l0", (2, 4, 8), (3e-3, 1e-3, 4e-3))  # a noisy low point at 4 samples
    profile = Profile(graph.fingerprint, "cpu", "float32", {"l0": measured})
    assert cost.compute_time(profile, graph.layers[0], 2, 8) == pytest.approx(2e-3)  # (3 + 1) / 2
    assert cost.compute_time(profile, graph.layers[0], 4, 8) == pytest.approx(2e-3)
    assert profile.layers["l0"] == measured  # the measurements themselves are kept


def test_small_groups_reduce_in_a_ring_and_large_ones_in_a_tree():
    comm = CommProfile(link=AlphaBeta(40e-6, 1 / 25e9))
    assert [comm.algorithm(n) for n in (2, 256)] == ["ring", "tree"]
    assert comm.allreduce_call(256).latency_s == pytest.approx(2 * 8 * 40e-6)  # 2 log2 N latencies
    measured = CommProfile(allreduce={2: AlphaBeta(1e-4, 1e-9)})
    assert measured.algorithm(2) == "measured" and measured.algorithm(4) in ("ring", "tree")


def test_data_parallel_time_grows_with_devices_by_the_latency_per_bucket_not_per_layer():
    # 16 layers of 1 MB gradients each; a fixed 4 samples per device, so compute stays the same.
    graph = graph_of([layer(f"l{i}", ["x" if i == 0 else f"l{i - 1}"], params=250_000) for i in range(16)])
    comm = CommProfile(link=AlphaBeta(40e-6, 1 / 25e9), overlap=False)
    steps = {}
    for n in (8, 256):
        profile = dataclasses.replace(
            linear_profile(graph, {f"l{i}": (1e-4, 1e-5) for i in range(16)}, max_batch=4 * n), comm=comm
        )
        steps[n] = cost.ddp_baseline(graph, profile, world_size=n, global_batch_size=4 * n).total_s
    grads = 16 * 1_000_000
    latency = (
        (comm.allreduce_call(256).latency_s - comm.allreduce_call(8).latency_s) * grads / comm.bucket_bytes
    )
    per_byte = (comm.allreduce_call(256).seconds_per_byte - comm.allreduce_call(8).seconds_per_byte) * grads
    assert steps[256] - steps[8] == pytest.approx(latency + per_byte)
    assert latency < 16 * 2 * 255 * 40e-6 / 100  # a hundredth of unbucketed ring latencies per layer


def test_sync_is_zero_on_one_device_and_the_allreduce_otherwise():
    big = layer("fc", ["x"], params=1_000_000)
    assert cost.sync_time(SLOW_LINK, big, 1) == 0.0
    assert cost.sync_time(SLOW_LINK, big, 4) == SLOW_LINK.allreduce_time(4, 4_000_000)
    assert cost.sync_time(SLOW_LINK, big, 4) > 0


def tied_graph() -> LayerGraph:
    """An embedding whose 1M-parameter weight the output head shares (counted at the embedding)."""
    layers = [
        layer("emb", ["x"], params=1_000_000),
        layer("body", ["emb"], params=1000),
        layer("head", ["body"], params=10),
    ]
    return dataclasses.replace(graph_of(layers), tied=(Tied("emb.weight", 4_000_000, ("emb", "head")),))


def test_a_shared_parameter_is_synced_once_among_its_widest_users_devices():
    graph = tied_graph()
    profile = linear_profile(graph, dict.fromkeys(("emb", "body", "head"), (1e-4, 1e-5)), max_batch=8)
    costs = cost.evaluate(graph, profile, {"emb": 1, "body": 2, "head": 2}, world_size=2, global_batch_size=8)
    assert costs.layers["emb"].sync_s == 0.0
    assert costs.layers["head"].sync_s == SLOW_LINK.allreduce_time(2, 40 + 4_000_000)
    assert cost.synced_bytes(graph, {"emb": 2, "body": 2, "head": 1}) == {
        "emb": 4_000_000,
        "body": 4000,
        "head": 40,
    }


def test_shared_parameters_round_trip_through_the_graphs_json_and_stay_out_of_graphs_without_them():
    graph = tied_graph()
    assert LayerGraph.from_dict(graph.to_dict()) == graph
    assert "tied" not in chain(2).to_dict()


def test_transfer_is_zero_between_equal_widths():
    assert cost.transfer_time(SLOW_LINK, 4096, 3, 3, **SIZES) == 0.0


def test_transfer_counts_forward_and_backward_over_the_busiest_rank():
    # 10 samples from (3,3,2,2) to (5,5,0,0): rank 1 keeps sample 5 and receives samples 6..9.
    assert busiest_rank_samples(balanced(10, 4, 4), balanced(10, 2, 4)) == 4
    expected = 2 * SLOW_LINK.redistribute_time(4 * 4096)
    assert cost.transfer_time(SLOW_LINK, 4096, 4, 2, **SIZES) == pytest.approx(expected)


def test_vectorized_busiest_samples_match_the_layout_reference():
    for world_size, batch in [(1, 3), (4, 4), (4, 10), (5, 7), (9, 31), (8, 8)]:
        widths = np.arange(1, world_size + 1)
        matrix = cost.busiest_samples(widths, world_size, batch)
        for a, b in itertools.product(widths, widths):
            reference = busiest_rank_samples(
                balanced(batch, int(a), world_size), balanced(batch, int(b), world_size)
            )
            assert matrix[a - 1, b - 1] == reference, (world_size, batch, a, b)


def test_input_edges_are_charged_to_the_consumer_and_output_return_to_the_producer():
    graph = chain(2, sample_bytes=1000)
    profile = linear_profile(graph, {"l0": (1e-3, 0), "l1": (1e-3, 0)}, max_batch=10)
    step = cost.evaluate(graph, profile, {"l0": 2, "l1": 2}, **SIZES)
    into = cost.transfer_time(SLOW_LINK, 4096, 4, 2, **SIZES, directions=1)
    assert step.layers["l0"].transfer_s == pytest.approx(into)
    assert step.layers["l1"].transfer_s == pytest.approx(cost.transfer_time(SLOW_LINK, 1000, 2, 4, **SIZES))


def test_a_batch_input_moves_forward_only_and_one_that_requires_grad_both_ways():
    graph = chain(1)
    profile = linear_profile(graph, {"l0": (1e-3, 0)}, max_batch=10)
    data = cost.evaluate(graph, profile, {"l0": 2}, **SIZES).layers["l0"].transfer_s
    inputs = (dataclasses.replace(graph.inputs[0], requires_grad=True),)
    graded = dataclasses.replace(graph, inputs=inputs)
    both = cost.evaluate(graded, profile, {"l0": 2}, **SIZES).layers["l0"].transfer_s
    returned = cost.transfer_time(SLOW_LINK, 4096, 2, 4, **SIZES)  # l0's output back to width 4
    assert data - returned == pytest.approx(cost.transfer_time(SLOW_LINK, 4096, 4, 2, **SIZES) / 2)
    assert both - returned == pytest.approx(cost.transfer_time(SLOW_LINK, 4096, 4, 2, **SIZES))


def test_an_input_that_requires_grad_round_trips_through_json_and_others_keep_their_fingerprint():
    graph = chain(1)
    graded = dataclasses.replace(graph, inputs=(dataclasses.replace(graph.inputs[0], requires_grad=True),))
    assert LayerGraph.from_dict(graded.to_dict()) == graded
    assert "requires_grad" not in graph.to_dict()["inputs"][0]
    assert graded.fingerprint != graph.fingerprint


def test_every_consumer_pays_for_its_own_edge():
    graph = graph_of([layer("a", ["x"]), layer("b", ["a"]), layer("c", ["a", "b"], module=False)])
    profile = linear_profile(graph, dict.fromkeys(["a", "b", "c"], (1e-3, 0)), max_batch=10)
    step = cost.evaluate(graph, profile, {"a": 4, "b": 1, "c": 1}, **SIZES)
    one_edge = cost.transfer_time(SLOW_LINK, 4096, 4, 1, **SIZES)
    assert step.layers["b"].transfer_s == pytest.approx(one_edge)
    assert step.layers["c"].transfer_s == pytest.approx(2 * one_edge)  # a -> c, and c back to the output


def test_step_time_is_the_sum_of_every_layers_compute_sync_and_transfer():
    graph = chain(3, params=1000)
    profile = linear_profile(graph, dict.fromkeys(["l0", "l1", "l2"], (1e-3, 1e-4)), max_batch=10)
    step = cost.evaluate(graph, profile, {"l0": 4, "l1": 1, "l2": 3}, **SIZES)
    assert step.total_s == pytest.approx(
        sum(c.compute_s + c.sync_s + c.transfer_s for c in step.layers.values())
    )


def test_ddp_baseline_has_no_transfers_and_syncs_every_layer_over_the_world():
    graph = chain(2, params=1000)
    profile = linear_profile(graph, dict.fromkeys(["l0", "l1"], (1e-3, 1e-4)), max_batch=10)
    ddp = cost.ddp_baseline(graph, profile, **SIZES)
    assert all(c.transfer_s == 0 for c in ddp.layers.values())
    assert ddp.layers["l0"].sync_s == SLOW_LINK.allreduce_time(4, 4000)
    assert ddp.layers["l0"].compute_s == pytest.approx(1e-3 + 3 * 1e-4)


def test_batch_smaller_than_world_is_rejected_with_what_to_change():
    with pytest.raises(
        ValueError, match=r"global batch size 3 is smaller than the world size 4;.*raise the batch"
    ):
        checks.check_sizes(4, 3)


def test_a_profile_of_another_graph_is_rejected():
    profile = linear_profile(chain(2), {"l0": (1e-3, 0), "l1": (1e-3, 0)}, max_batch=10)
    with pytest.raises(ValueError, match=r"the profile was made for graph .* profile this model again"):
        checks.check_profile(chain(3), profile)


# ---------------------------------------------------------------------------- spatial splits
def splittable(height: int = 10, halo_bytes: int = 0) -> Layer:
    """A layer reading ``x`` (4000 bytes per sample) that can be split by height."""
    return dataclasses.replace(layer("c", ["x"]), height=height, halo_bytes=halo_bytes)


def test_a_part_computes_its_groups_batch_scaled_to_its_share_of_the_rows():
    graph = graph_of([splittable(height=10)], input_bytes=4000)
    profile = linear_profile(graph, {"c": (1e-3, 1e-4)}, max_batch=10)
    # 2 groups of 5 samples, each sample's 10 rows in 2 parts of 5: 2.5 samples' worth.
    assert cost.compute_time(profile, graph.layers[0], Placement(4, 2), 10) == pytest.approx(1e-3 + 2.5e-4)


def test_an_uneven_split_costs_the_larger_part():
    graph = graph_of([splittable(height=5)], input_bytes=4000)
    profile = linear_profile(graph, {"c": (1e-3, 1e-4)}, max_batch=10)
    # 1 group of 10 samples, 5 rows in parts of 3 and 2: 10 * 3 / 5 = 6 samples' worth.
    assert cost.compute_time(profile, graph.layers[0], Placement(2, 2), 10) == pytest.approx(1e-3 + 6e-4)


def test_the_halo_a_part_reads_adds_its_share_of_a_sample():
    graph = graph_of([splittable(height=10, halo_bytes=800)], input_bytes=4000)
    profile = linear_profile(graph, {"c": (1e-3, 1e-4)}, max_batch=10)
    assert cost.halo_share(graph, graph.layers[0]) == pytest.approx(0.2)
    compute = cost.compute_time(profile, graph.layers[0], Placement(4, 2), 10, halo=0.2)
    assert compute == pytest.approx(1e-3 + 5 * (0.5 + 0.2) * 1e-4)


def test_below_the_smallest_profiled_batch_time_follows_the_two_smallest_and_keeps_fixed_costs():
    measured = LayerProfile("c", (2, 4, 8), (3e-3, 5e-3, 6e-3))
    # The line through (2, 3 ms) and (4, 5 ms): 1 ms + 1 ms per sample.
    assert cost.fractional_time(measured, 0.5) == pytest.approx(1.5e-3)
    assert cost.fractional_time(measured, 3.0) == pytest.approx(4e-3)  # interpolated inside the range
    steep = LayerProfile("c", (2, 4), (1e-3, 9e-3))  # the line crosses zero at 1.75 samples
    assert cost.fractional_time(steep, 1.0) == 0.0


def test_a_single_profiled_batch_scales_in_proportion_below_it():
    assert cost.fractional_time(LayerProfile("c", (1,), (4e-3,)), 0.25) == pytest.approx(1e-3)


def test_a_split_layers_halo_exchange_costs_its_halo_per_group_sample_both_ways():
    big = splittable(height=10, halo_bytes=800)
    assert cost.halo_time(SLOW_LINK, big, Placement(4), 10) == 0.0
    expected = 2 * SLOW_LINK.redistribute_time(800 * 5)  # 2 groups of 5 samples
    assert cost.halo_time(SLOW_LINK, big, Placement(4, 2), 10) == pytest.approx(expected)


def test_a_measured_halo_model_prices_halo_exchanges_and_moves_to_or_from_split_placements():
    big = splittable(height=10, halo_bytes=800)
    comm = dataclasses.replace(SLOW_LINK, halo=AlphaBeta(latency_s=1e-6, seconds_per_byte=1e-12))
    assert cost.halo_time(comm, big, Placement(4, 2), 10) == pytest.approx(2 * (1e-6 + 800 * 5 * 1e-12))
    sizes = {"world_size": 4, "global_batch_size": 8}
    # Rank 0 holds samples 0-1 at width 4 and rows 0-4 of samples 0-3 at 4s2: it sends half of
    # sample 1 and receives half of samples 2 and 3, the busiest rank's share (a sample's worth).
    to_split = cost.transfer_time(comm, 4096, 4, Placement(4, 2), **sizes, rows=10)
    assert to_split == pytest.approx(2 * (1e-6 + 4096 * 1e-12))
    unsplit = cost.transfer_time(comm, 4096, 1, 4, **sizes)
    assert unsplit == cost.transfer_time(SLOW_LINK, 4096, 1, 4, **sizes)


def test_a_halo_model_survives_json_and_profiles_without_one_load_with_none():
    comm = CommProfile(halo=AlphaBeta(2e-5, 1e-10))
    assert CommProfile.from_dict(comm.to_dict()) == comm
    older = {key: value for key, value in comm.to_dict().items() if key != "halo"}
    assert CommProfile.from_dict(older).halo is None


def test_vectorized_busiest_shares_match_the_layout_reference():
    for world_size, batch, rows in [(2, 1, 7), (4, 2, 5), (4, 3, 9), (6, 5, 4), (8, 8, 16)]:
        options = [Placement(w, s) for w in range(1, world_size + 1) for s in range(1, w + 1) if w % s == 0]
        matrix = cost.busiest_shares(options, rows, world_size, batch)
        for (i, a), (j, b) in itertools.product(enumerate(options), repeat=2):
            reference = busiest_rank_share(
                Layout.of(a, batch, world_size), Layout.of(b, batch, world_size), rows
            )
            assert matrix[i, j] == pytest.approx(reference, abs=1e-12), (world_size, batch, rows, a, b)


def test_busiest_shares_between_unsplit_placements_are_the_busiest_samples():
    widths = [Placement(w) for w in range(1, 5)]
    assert np.array_equal(cost.busiest_shares(widths, 7, 4, 10), cost.busiest_samples(np.arange(1, 5), 4, 10))


def test_moving_into_a_split_costs_the_busiest_ranks_share_both_ways():
    # One sample on rank 0 (width 2, batch 1) to two halves of it on ranks 0 and 1: rank 1 receives half.
    expected = 2 * SLOW_LINK.redistribute_time(0.5 * 4096)
    sizes = dict(world_size=2, global_batch_size=1)
    assert cost.transfer_time(SLOW_LINK, 4096, 2, Placement(2, 2), **sizes, rows=512) == pytest.approx(
        expected
    )
    with pytest.raises(ValueError, match=r"moving a value between 2 and 2s2 needs its rows"):
        cost.transfer_time(SLOW_LINK, 4096, 2, Placement(2, 2), **sizes)


def spatial_graph() -> LayerGraph:
    """x -> conv0 -> conv1 (both 8 rows high, 1 kB halo) -> head (not splittable)."""
    convs = [
        dataclasses.replace(
            layer(f"conv{i}", ["x" if i == 0 else "conv0"], params=1000), height=8, halo_bytes=1024
        )
        for i in range(2)
    ]
    return graph_of([*convs, layer("head", ["conv1"], sample_bytes=64, params=100)])


def test_evaluate_charges_halo_exchange_and_moves_between_splits_as_transfer():
    graph = spatial_graph()
    profile = linear_profile(graph, dict.fromkeys(("conv0", "conv1", "head"), (1e-3, 1e-4)), max_batch=4)
    sizes = dict(world_size=4, global_batch_size=2)
    placements = {"conv0": Placement(4, 2), "conv1": Placement(4, 4), "head": 1}
    step = cost.evaluate(graph, profile, placements, **sizes)
    halo = cost.halo_time(SLOW_LINK, graph.layer("conv1"), Placement(4, 4), 2)
    into = cost.transfer_time(SLOW_LINK, 4096, Placement(4, 2), Placement(4, 4), **sizes, rows=8)
    assert step.layers["conv1"].transfer_s == pytest.approx(into + halo)
    assert step.layers["conv1"].sync_s == SLOW_LINK.allreduce_time(4, 4000)  # among all 4 ranks
    # 1 group of 2 samples, 8 rows in 4 parts, 1 kB halo of a 4 kB input: 2 * (2/8 + 1/4) samples.
    assert step.layers["conv1"].compute_s == pytest.approx(1e-3 + 1.0 * 1e-4)
    gather = cost.transfer_time(SLOW_LINK, 4096, Placement(4, 4), 1, **sizes, rows=8)
    assert step.layers["head"].transfer_s == pytest.approx(
        gather + cost.transfer_time(SLOW_LINK, 64, 1, 4, **sizes)
    )


def test_a_batch_smaller_than_the_world_is_allowed_when_a_layer_can_be_split_by_height():
    checks.check_sizes(4, 1, spatial_graph())
    with pytest.raises(
        ValueError,
        match=r"global batch size 3 is smaller than the world size 4; no layer can be split by height",
    ):
        checks.check_sizes(4, 3, chain(2))


def test_a_loss_inside_forward_needs_a_sample_on_every_rank():
    graph = spatial_graph()
    graph = dataclasses.replace(
        graph, layers=(*graph.layers[:2], dataclasses.replace(graph.layers[2], per_rank=True))
    )
    with pytest.raises(
        ValueError, match=r"layer 'head' reduces over each rank's own samples .* batch size 2 is smaller than"
    ):
        checks.check_sizes(4, 2, graph)


def test_with_fewer_samples_than_devices_the_ddp_baseline_runs_on_as_many_devices_as_samples():
    graph = spatial_graph()
    profile = linear_profile(graph, dict.fromkeys(("conv0", "conv1", "head"), (1e-3, 1e-4)), max_batch=4)
    ddp = cost.ddp_baseline(graph, profile, world_size=4, global_batch_size=2)
    on_two = cost.evaluate(graph, profile, cost.ddp_widths(graph, 2), world_size=4, global_batch_size=2)
    assert ddp == on_two
    assert all(c.transfer_s == 0 for c in ddp.layers.values())


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3, Placement(3)),
        (Placement(4, 2), Placement(4, 2)),
        ({"width": 4, "spatial": 2}, Placement(4, 2)),
        ({"width": 2}, Placement(2)),
    ],
)
def test_a_placement_is_a_width_a_placement_or_a_mapping(value, expected):
    assert checks.as_placement(value, "pin 'a'") == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"spatial": 2}, r"pin 'a': \{'spatial': 2\} has no 'width'"),
        ({"width": 4, "split": 2}, r"unknown keys \['split'\]"),
        (True, r"pin 'a': True is not a width \(an int\)"),
        ({"width": "4"}, r"is not a width"),
    ],
)
def test_anything_else_is_an_error_showing_the_expected_form(value, message):
    with pytest.raises(ValueError, match=message):
        checks.as_placement(value, "pin 'a'")


def _two_layers_at_full_width(seconds_per_byte: float, *, overlap: bool):
    """Two 3 ms layers with 2 MB of gradients each (a bucket each) at width 2: no transfer."""
    graph = graph_of([layer("l0", ["x"], params=500_000), layer("l1", ["l0"], params=500_000)])
    comm = CommProfile(link=AlphaBeta(0.0, seconds_per_byte), overlap=overlap)
    profile = linear_profile(graph, {"l0": (3e-3, 0.0), "l1": (3e-3, 0.0)}, max_batch=4, comm=comm)
    return cost.evaluate(graph, profile, {"l0": 2, "l1": 2}, world_size=2, global_batch_size=4)


@pytest.mark.parametrize(
    ("seconds_per_byte", "step_s"),
    [
        # forward 2 ms; l1's backward ends at 4 ms and its bucket reduces 4-5; l0's ends at 6, reduces 6-7
        (5e-10, 7e-3),
        # 3 ms per bucket: l1's reduces 4-7, so l0's, ready at 6, waits for it and reduces 7-10
        (1.5e-9, 10e-3),
    ],
)
def test_all_reduces_run_beside_backward_a_bucket_after_its_layers_and_the_bucket_before(
    seconds_per_byte, step_s
):
    step = _two_layers_at_full_width(seconds_per_byte, overlap=True)
    assert step.total_s == pytest.approx(step_s)
    assert step.serial_s - step.hidden_s == pytest.approx(step_s)


def test_without_overlap_all_reduces_follow_backward():
    step = _two_layers_at_full_width(5e-10, overlap=False)
    assert step.hidden_s == 0
    assert step.total_s == pytest.approx(6e-3 + 2e-3)


def _small_bucket_last(contention: float, *, overlap: bool = True):
    """Two 3 ms layers at width 2: l1's 2 MB of gradients reduce in 1 ms beside l0's backward (4-6 ms),
    l0's 0.2 MB in 0.1 ms after it."""
    graph = graph_of([layer("l0", ["x"], params=50_000), layer("l1", ["l0"], params=500_000)])
    comm = CommProfile(link=AlphaBeta(0.0, 5e-10), overlap=overlap, contention=contention)
    profile = linear_profile(graph, {"l0": (3e-3, 0.0), "l1": (3e-3, 0.0)}, max_batch=4, comm=comm)
    return cost.evaluate(graph, profile, {"l0": 2, "l1": 2}, world_size=2, global_batch_size=4)


@pytest.mark.parametrize(
    ("contention", "step_s"),
    [
        (0.0, 6.1e-3),  # backward ends at 6 ms, l0's bucket at 6.1
        (0.05, 6.1e-3),  # backward ends 0.05 ms later, still before l0's bucket
        (0.5, 6.5e-3),  # half speed beside l1's 1 ms all-reduce: backward ends 0.5 ms later
    ],
)
def test_compute_beside_an_all_reduce_loses_the_contention_share_of_its_speed(contention, step_s):
    step = _small_bucket_last(contention)
    assert step.total_s == pytest.approx(step_s)
    assert step.hidden_s == pytest.approx(1e-3)
    assert step.contention_s == pytest.approx(step_s - 6.1e-3)


def test_without_overlap_contention_slows_nothing():
    step = _small_bucket_last(0.5, overlap=False)
    assert step.contention_s == 0
    assert step.total_s == pytest.approx(6e-3 + 1.1e-3)


@pytest.mark.parametrize("contention", [-0.1, 1.0])
def test_contention_outside_zero_to_one_is_an_error(contention):
    with pytest.raises(ValueError, match=r"contention .* must be in \[0, 1\), got"):
        CommProfile(contention=contention)


def test_contention_survives_json_and_older_profiles_load_with_none_at_zero():
    comm = CommProfile(contention=0.3)
    assert CommProfile.from_dict(comm.to_dict()) == comm
    older = {key: value for key, value in comm.to_dict().items() if key != "contention"}
    assert CommProfile.from_dict(older).contention == 0.0
