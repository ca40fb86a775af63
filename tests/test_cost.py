"""The cost model: compute at ceil(B / w), sync among the layer's devices, transfers on width changes."""

import dataclasses
import itertools

import numpy as np
import pytest

from lightning_deeppool.planner import cost
from lightning_deeppool.planner.graph import LayerGraph, Tied
from lightning_deeppool.planner.layout import balanced, busiest_rank_samples
from lightning_deeppool.planner.profile import AlphaBeta, CommProfile, LayerProfile, Profile

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
    comm = CommProfile(link=AlphaBeta(40e-6, 1 / 25e9))
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
    assert step.layers["l0"].transfer_s == pytest.approx(cost.transfer_time(SLOW_LINK, 4096, 4, 2, **SIZES))
    assert step.layers["l1"].transfer_s == pytest.approx(cost.transfer_time(SLOW_LINK, 1000, 2, 4, **SIZES))


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


def test_memory_per_rank_counts_only_the_layers_a_rank_runs():
    graph = chain(2, params=1000)
    profile = linear_profile(
        graph,
        dict.fromkeys(["l0", "l1"], (1e-3, 1e-4)),
        max_batch=10,
        peak_bytes_per_sample={"l0": 100, "l1": 1000},
    )
    memory = cost.memory_per_rank(graph, profile, {"l0": 4, "l1": 1}, **SIZES)
    l0, l1 = 100 * 3 + 8000, 1000 * 10 + 8000
    assert memory == [l0 + l1, l0, l0, l0]


def test_batch_smaller_than_world_is_rejected_with_what_to_change():
    with pytest.raises(
        ValueError, match=r"global batch size 3 is smaller than the world size 4;.*raise the batch"
    ):
        cost.check_sizes(4, 3)


def test_a_profile_of_another_graph_is_rejected():
    profile = linear_profile(chain(2), {"l0": (1e-3, 0), "l1": (1e-3, 0)}, max_batch=10)
    with pytest.raises(ValueError, match=r"the profile was made for graph .* profile this model again"):
        cost.check_profile(chain(3), profile)
