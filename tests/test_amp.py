"""Mixed precision: under a burst plan ranks agree on overflow and a rank without gradients can
step; bf16 autocast runs the plan like Lightning's DDP on one device."""

import pytest
import torch

from lightning_deeppool import DeepPoolStrategy
from lightning_deeppool.session.modules import patch_scaler_overflow

from distributed import run_distributed
from models import fit_one_device, max_param_diff

pytestmark = pytest.mark.floors


def _step(rank: int, overflow_on: int | None, owners: int) -> tuple[float, float]:
    """One scaled step per rank; ranks below `owners` own the parameter, rank `overflow_on` sees an
    inf gradient. Returns (weight, scale)."""
    owns_param = rank < owners
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    patch_scaler_overflow(scaler, torch.device("cpu"))
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.5)
    if not owns_param:  # as the strategy prunes it
        optimizer.param_groups[0]["params"].clear()
    scaled = scaler.scale(torch.ones(()))
    if owns_param:
        param.grad = torch.full((2,), float(scaled))
        if rank == overflow_on:
            param.grad[0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    return param[1].item(), scaler.get_scale()


def test_every_rank_skips_the_step_when_one_rank_overflows():
    results = run_distributed(_step, 2, 1, 2)
    assert results == [(1.0, 4.0), (1.0, 4.0)]


def test_a_rank_that_owns_no_parameter_follows_rank_zero_overflow():
    results = run_distributed(_step, 2, 0, 1)
    assert results == [(1.0, 4.0), (1.0, 4.0)]


def test_ranks_step_and_keep_the_scale_when_nothing_overflows():
    results = run_distributed(_step, 2, None, 1)
    assert results == [(0.5, 8.0), (1.0, 8.0)]


def test_bf16_mixed_on_one_device_trains_like_lightnings_ddp():
    reference, reference_losses = fit_one_device("ddp", precision="bf16-mixed")
    strategy = DeepPoolStrategy(cache_dir=False, profile_warmup=1, profile_repeats=1)
    planned, losses = fit_one_device(strategy, precision="bf16-mixed")
    # bf16 moves these losses by 2e-4 to 1e-3 from float32's: agreeing to 1e-5 means the plan ran
    # under the same autocast.
    assert max_param_diff(planned, reference) < 1e-5
    assert losses == pytest.approx(reference_losses, abs=1e-5)
