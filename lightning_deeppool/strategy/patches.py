"""Every place the strategy patches another library's objects or uses its private code.

Each is tested in `tests/test_patches.py` against the installed torch and Lightning, so an upgrade that
changes one fails there, not in a training run:

- `patch_scaler_overflow`: `16-mixed` under a burst plan needs every rank to agree whether a step's
  gradients overflowed. Each rank's GradScaler only sees the gradients it owns, so ranks could
  disagree on skipping a step and on the next loss scale (a rank that owns nothing would even fail:
  `No inf checks were recorded for this optimizer`). Reads `GradScaler._per_optimizer_states`.
- `wrap_wait_between_steps`: Lightning's training loop broadcasts rank 0's SIGTERM flag before every
  step (`_broadcast_sigterm_tensor`, private); a rank that finished its part of the step early waits
  there, idle like any wait in the plan, in a collective every rank issues.
- `clip_by_global_norm`: replaces the precision plugin's `clip_grad_by_norm` on the instance.
- `replace_forward`: the planned module's `forward` replaced on the instance.
- `take_compiler`: `trainer.fit(torch.compile(model))` leaves the LightningModule's forward and step
  methods compiled (`_compiler_ctx`, private); `model.compile()` its call (`_compiled_call_impl`,
  whose closure holds dynamo's context, private); the strategy restores them and compiles its layers.
- `sync_module_states`, `sync_buffers`, `optimizers_to_device`: private functions of torch and
  Lightning the strategy calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.utilities.compile import to_uncompiled
from torch import nn
from torch.distributed.distributed_c10d import _get_default_group
from torch.distributed.utils import _sync_params_and_buffers

from lightning_deeppool.install import Compiler

sync_module_states = _sync_module_states  # rank 0's parameters and buffers to every rank (collective)
optimizers_to_device = _optimizers_to_device

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # Lightning's and DDP's

# The private method of Lightning's training epoch loop that broadcasts the SIGTERM flag each step.
SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"


def sync_buffers(module: nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running statistics, say) to every rank, in buckets as
    `sync_module_states` broadcasts them (collective; none where the module has none). Only buffers
    whose values differ are written: a backward still to run may have saved the others."""
    buffers = [buffer.detach() for buffer in module.buffers()]
    if not buffers:
        return
    received = [buffer.clone() for buffer in buffers]
    _sync_params_and_buffers(_get_default_group(), received, BROADCAST_BUCKET_BYTES, 0)
    for buffer, value in zip(buffers, received):
        if not torch.equal(buffer, value):
            buffer.copy_(value)


def take_compiler(module: pl.LightningModule) -> Compiler | None:
    """The compiler of a LightningModule given to `fit` compiled, or compiled in place by
    `module.compile()` (None if neither), its forward and step methods restored to their own: dynamo
    must not trace the strategy's code they call."""
    in_place = module._compiled_call_impl
    if in_place is not None:
        module._compiled_call_impl = None
        return _dynamo_context(in_place)
    context = module._compiler_ctx
    if context is None:
        return None
    to_uncompiled(module)
    return context["dynamo_ctx"]


def _dynamo_context(compiled: Callable[..., Any]) -> Compiler:
    """The context `torch.compile` wrapped `compiled` with (its backend, mode and options): a compiler."""
    for cell in compiled.__closure__ or ():
        if isinstance(cell.cell_contents, torch._dynamo.eval_frame._TorchDynamoContext):
            return cell.cell_contents  # type: ignore[no-any-return]
    raise RuntimeError(
        "deeppool: the module was compiled in place (module.compile()) in a way whose options this "
        "version of deeppool cannot read; pass trainer.fit(torch.compile(model, ...)) instead, or "
        "DeepPoolStrategy(compile_layers={...}) with torch.compile's options"
    )


def agree_on_overflow(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, device: torch.device
) -> None:
    """Make `found_inf` the same on every rank (collective: call on all ranks after `unscale_`)."""
    found: dict[torch.device, torch.Tensor] = scaler._per_optimizer_states[id(optimizer)][
        "found_inf_per_device"
    ]
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    for value in found.values():
        flag = torch.maximum(flag, value.to(device, torch.float32).reshape(1))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not found:
        found[device] = flag.reshape(())
    for value in found.values():
        value.fill_(flag.item())


def patch_scaler_overflow(scaler: torch.amp.GradScaler, device: torch.device) -> None:
    """Wrap `scaler.unscale_` (which `scaler.step` also calls) so every rank agrees afterwards."""
    unscale = scaler.unscale_

    def unscale_(optimizer: Any) -> None:
        unscale(optimizer)
        agree_on_overflow(scaler, optimizer, device)

    scaler.unscale_ = unscale_  # type: ignore[method-assign]


def replace_wait_between_steps(
    epoch_loop: Any, wait: Callable[[Callable[[], None]], None]
) -> Callable[[], None]:
    """Run `wait(broadcast)` instead of the loop's wait for rank 0 before each step, where `broadcast`
    is Lightning's own (rank 0's SIGTERM flag to every rank, raising `SIGTERMException` where it is
    set); returns the undo."""
    broadcast = getattr(epoch_loop, SIGTERM_BROADCAST, None)
    if broadcast is None:
        return lambda: None
    setattr(epoch_loop, SIGTERM_BROADCAST, lambda: wait(broadcast))

    def restore() -> None:
        if SIGTERM_BROADCAST in vars(epoch_loop):
            delattr(epoch_loop, SIGTERM_BROADCAST)

    return restore


def clip_by_global_norm(plugin: Any, norm_of: Callable[[list[torch.Tensor]], torch.Tensor]) -> None:
    """Make `plugin.clip_grad_by_norm` clip by `norm_of` the gradients it holds (a norm every rank
    agrees on) instead of this rank's own norm."""
    main_params: Callable[[Any], Any] = plugin.main_params

    def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
        grads = [p for p in main_params(optimizer) if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(grads, clip_val, norm_of([p.grad for p in grads]))

    plugin.clip_grad_by_norm = clip_grad_by_norm


def replace_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    """Calls of `module` run `forward` (on this instance) until `restore_forward`; returns the
    module's own forward, bound."""
    own = type(module).forward.__get__(module)
    module.forward = forward  # type: ignore[method-assign]
    return own


@contextmanager
def own_forward(module: nn.Module) -> Iterator[None]:
    """`module`'s own forward inside (capture calls the module)."""
    replacement = vars(module).get("forward")
    restore_forward(module)
    try:
        yield
    finally:
        if replacement is not None:
            module.forward = replacement  # type: ignore[method-assign]


def restore_forward(module: nn.Module) -> None:
    if "forward" in vars(module):
        del module.forward
