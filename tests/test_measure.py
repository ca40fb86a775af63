import time

import pytest

from lightning_deeppool.ir.profile import CommProfile
from lightning_deeppool.profiling.comm import default_group_sizes, fit_alpha_beta, measure_comm

from distributed import run_distributed


def _measure(rank: int) -> tuple[CommProfile, float]:
    start = time.perf_counter()
    comm = measure_comm(device="cpu")
    return comm, time.perf_counter() - start


@pytest.fixture(scope="module")
def two_ranks() -> list[tuple[CommProfile, float]]:
    return run_distributed(_measure, 2)


def test_measure_comm_without_process_group_returns_the_defaults():
    assert measure_comm(device="cpu") == CommProfile()


def test_measure_comm_is_identical_on_every_rank(two_ranks):
    (first, _), (second, _) = two_ranks
    assert first == second


def test_measure_comm_fits_allreduce_and_redistribution(two_ranks):
    comm, _ = two_ranks[0]
    assert comm.measured
    assert list(comm.allreduce) == [2]
    assert comm.redistribute is not None and comm.link == comm.redistribute


def test_measured_latency_is_not_negative_and_bandwidth_is_positive(two_ranks):
    comm, _ = two_ranks[0]
    for model in (comm.allreduce[2], comm.redistribute):
        # A noisy machine can fit a line through the origin; the fit clamps latency at 0 (see below).
        assert model.latency_s >= 0
        assert 0 < model.seconds_per_byte < 1e-6  # slower than 1 MB/s would be a measuring bug


def test_cpu_ranks_of_one_host_measure_the_links_of_their_halo_exchanges(two_ranks):
    comm, _ = two_ranks[0]
    assert comm.halo is not None and comm.redistribute is not None
    assert comm.halo.latency_s > 0
    assert comm.halo.seconds_per_byte == comm.redistribute.seconds_per_byte


def test_measure_comm_is_fast(two_ranks):
    assert max(seconds for _, seconds in two_ranks) < 1.5


def _measure_subgroups(rank: int) -> CommProfile:
    return measure_comm(device="cpu", sizes_bytes=(4096, 1 << 18), repeats=1)


def test_measure_comm_measures_every_subgroup_size():
    results = run_distributed(_measure_subgroups, 3)
    assert all(comm == results[0] for comm in results)
    assert list(results[0].allreduce) == [2, 3]


@pytest.mark.parametrize(
    ("world_size", "expected"),
    [(2, [2]), (8, [2, 3, 4, 5, 6, 7, 8]), (12, [2, 4, 8, 12]), (16, [2, 4, 8, 16])],
)
def test_default_group_sizes(world_size, expected):
    assert default_group_sizes(world_size) == expected


def test_fit_alpha_beta_recovers_an_exact_line():
    model = fit_alpha_beta([(n, 1e-4 + n * 2e-9) for n in (4096, 1 << 20, 4 << 20)])
    assert model.latency_s == pytest.approx(1e-4)
    assert model.seconds_per_byte == pytest.approx(2e-9)


def test_fit_alpha_beta_clamps_a_negative_latency_to_zero():
    model = fit_alpha_beta([(1000, 1e-6), (2000, 3e-6)])
    assert model.latency_s == 0
    assert model.seconds_per_byte > 0
