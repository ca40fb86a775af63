"""Every patch of another library, and every private call the package makes, against the installed
torch and Lightning: an upgrade that changes one fails here (`strategy/patches.py` and
`session/modules.py` list them)."""

from __future__ import annotations

import inspect

import pytest
import torch
from lightning.pytorch.core.optimizer import _configure_optimizers, _configure_schedulers_automatic_opt
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_deeppool.runtime.runtime import _accumulates
from lightning_deeppool.session.modules import (
    agree_on_overflow,
    own_forward,
    replace_forward,
    restore_forward,
    sync_buffers,
    sync_module_states,
)
from lightning_deeppool.strategy.patches import (
    SIGTERM_BROADCAST,
    clip_by_global_norm,
    optimizers_to_device,
    replace_wait_between_steps,
    take_compiler,
)

from distributed import run_distributed
from models import MLP

pytestmark = pytest.mark.floors


def test_grad_scaler_keeps_each_optimizers_found_inf_per_device():
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.tensor([1.0, float("inf")])
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    scaler.unscale_(optimizer)
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    assert [float(v) for v in found.values()] == [1.0]


def _overflow_agreed(rank: int) -> float:
    param = nn.Parameter(torch.ones(1))
    param.grad = torch.tensor([float("inf") if rank == 1 else 1.0])
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    scaler.unscale_(optimizer)
    agree_on_overflow(scaler, optimizer, torch.device("cpu"))
    return float(sum(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()))


def test_an_overflow_on_one_rank_is_found_on_every_rank():
    assert run_distributed(_overflow_agreed, 2) == [1.0, 1.0]


def test_lightnings_epoch_loop_broadcasts_the_sigterm_flag_before_each_step_through_its_method():
    assert callable(getattr(_TrainingEpochLoop, SIGTERM_BROADCAST))
    assert f"self.{SIGTERM_BROADCAST}()" in inspect.getsource(_TrainingEpochLoop.advance)


def test_the_wait_before_each_step_is_replaced_until_restored():
    class Loop:
        calls = 0

        def _broadcast_sigterm_tensor(self) -> None:
            Loop.calls += 1

    loop, waits = Loop(), []
    restore = replace_wait_between_steps(loop, lambda broadcast: waits.append(broadcast))
    getattr(loop, SIGTERM_BROADCAST)()
    assert Loop.calls == 0 and len(waits) == 1
    waits[0]()  # Lightning's own broadcast, given to the replacement
    restore()
    getattr(loop, SIGTERM_BROADCAST)()
    assert Loop.calls == 2


def test_precision_clips_by_norm_through_clip_grad_by_norm_with_the_norm_given():
    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([3.0, 4.0])  # norm 5 on this rank
    optimizer = torch.optim.SGD([param], lr=0.1)
    plugin = Precision()
    clip_by_global_norm(plugin, lambda grads: torch.tensor(10.0))  # the global norm: 10
    plugin.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm="norm")
    assert param.grad.tolist() == pytest.approx([0.3, 0.4], abs=1e-6)  # by its own norm: 0.6, 0.8


def test_a_replaced_forward_serves_calls_until_restored_and_the_own_one_inside_own_forward():
    module = nn.Linear(2, 2)
    own = replace_forward(module, lambda x: "replaced")
    x = torch.ones(1, 2)
    assert module(x) == "replaced"
    with own_forward(module):
        assert torch.equal(module(x), own(x))
    assert module(x) == "replaced"
    restore_forward(module)
    assert torch.equal(module(x), own(x))


def _synced(rank: int) -> list[float]:
    module = nn.Linear(1, 1)
    with torch.no_grad():
        module.weight.fill_(float(rank + 1))
    sync_module_states(module)
    optimizers_to_device([torch.optim.SGD(module.parameters(), lr=0.1)], torch.device("cpu"))
    return [module.weight.item()]


def test_module_states_come_from_rank_zero():
    assert run_distributed(_synced, 2) == [[1.0], [1.0]]


def _buffers_synced(rank: int) -> list[float]:
    module = nn.BatchNorm1d(1)
    with torch.no_grad():
        module.weight.fill_(float(rank + 1))
        module.running_mean.fill_(float(rank + 1))
    sync_buffers(module)
    return [module.running_mean.item(), module.weight.item()]


def test_buffers_come_from_rank_zero_and_parameters_stay():
    assert run_distributed(_buffers_synced, 2) == [[1.0, 1.0], [1.0, 2.0]]


def test_the_engine_says_whether_a_backward_accumulates_into_leaves():
    assert callable(torch._C._will_engine_execute_node)

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, anchor, x):  # type: ignore[override]
            ctx.anchor = anchor
            return x.clone()

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            seen.append(_accumulates(ctx))
            return None, grad

    seen: list[bool] = []
    anchor, x = torch.zeros((), requires_grad=True), torch.ones(2, requires_grad=True)
    Probe.apply(anchor, x).sum().backward()
    torch.autograd.grad(Probe.apply(anchor, x).sum(), x)
    assert seen == [True, False]


def test_lightning_configures_a_background_jobs_optimizers_and_schedulers():
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    optimizers, schedulers, monitor = _configure_optimizers(([optimizer], [scheduler]))
    configs = _configure_schedulers_automatic_opt(schedulers, monitor)
    assert optimizers == [optimizer] and [c.scheduler for c in configs] == [scheduler]


def test_the_compiler_of_a_module_compiled_in_place_is_taken_from_its_call():
    model = MLP()
    model.compile(backend="eager")
    compiler = take_compiler(model)
    assert isinstance(compiler, torch._dynamo.eval_frame._TorchDynamoContext)
    assert model._compiled_call_impl is None
    assert take_compiler(model) is None
