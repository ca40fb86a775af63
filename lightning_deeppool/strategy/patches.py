"""Every place the Trainer's strategy patches Lightning's objects or uses its private code.

Each is tested in `tests/test_patches.py` against the installed torch and Lightning, so an upgrade that
changes one fails there, not in a training run:

- `wrap_wait_between_steps`: Lightning's training loop broadcasts rank 0's SIGTERM flag before every
  step (`_broadcast_sigterm_tensor`, private); a rank that finished its part of the step early waits
  there, idle like any wait in the plan, in a collective every rank issues.
- `clip_by_global_norm`: replaces the precision plugin's `clip_grad_by_norm` on the instance.
- `take_compiler`: `trainer.fit(torch.compile(model))` leaves the LightningModule's forward and step
  methods compiled (`_compiler_ctx`, private); `model.compile()` its call (`_compiled_call_impl`,
  whose closure holds dynamo's context, private); the strategy restores them and compiles its layers.
- `optimizers_to_device`: a private function of Lightning the strategy calls.

What both front doors do with torch alone is in `session/modules.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.utilities.compile import to_uncompiled

from lightning_deeppool.install import Compiler

optimizers_to_device = _optimizers_to_device

# The private method of Lightning's training epoch loop that broadcasts the SIGTERM flag each step.
SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"


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
