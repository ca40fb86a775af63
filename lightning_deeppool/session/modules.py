"""What both front doors do to the user's module, optimizers and scaler with torch alone, including
every private torch call they make (each tested in `tests/test_patches.py` against the installed torch):

- `sync_module_states`, `sync_buffers`: rank 0's parameters and buffers to every rank, through torch's
  private `_sync_module_states` and `_sync_params_and_buffers` (what DDP's constructor calls).
- `replace_forward`: the planned module's `forward` replaced on the instance.
- `patch_scaler_overflow`: `16-mixed` under a burst plan needs every rank to agree whether a step's
  gradients overflowed. Each rank's GradScaler only sees the gradients it owns, so ranks could
  disagree on skipping a step and on the next loss scale (a rank that owns nothing would even fail:
  `No inf checks were recorded for this optimizer`). Reads `GradScaler._per_optimizer_states`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _get_default_group
from torch.distributed.utils import _sync_module_states, _sync_params_and_buffers

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # Lightning's and DDP's


def sync_module_states(module: nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank, as DDP's constructor sends them (collective)."""
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    _sync_module_states(module, _get_default_group(), BROADCAST_BUCKET_BYTES, 0, ignored)


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


def planned_submodule(module: nn.Module, name: str | None) -> nn.Module:
    """The submodule `name` of `module` whose forward is planned (`module` itself for None); raises
    ValueError naming `module`'s children where it has none of that name."""
    if name is None:
        return module
    try:
        return module.get_submodule(name)
    except AttributeError:
        names = [child for child, _ in module.named_children()]
        raise ValueError(
            f"DeepPoolStrategy(module={name!r}): {type(module).__name__} has no such submodule; its "
            f"children are {names}"
        ) from None
