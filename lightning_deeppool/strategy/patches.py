"""`16-mixed` under a burst plan: every rank must agree whether this step's gradients overflowed.

Each rank's GradScaler only sees the gradients it owns, so ranks could disagree on skipping a step
and on the next loss scale. A rank that owns nothing would even fail (`No inf checks were recorded
for this optimizer`). After every `unscale_`, the ranks take the max of their verdicts.

This reads `GradScaler._per_optimizer_states`, a private structure; it is isolated here and tested.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


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


def make_scaler_agree(scaler: torch.amp.GradScaler, device: torch.device) -> None:
    """Wrap `scaler.unscale_` (which `scaler.step` also calls) so every rank agrees afterwards."""
    unscale = scaler.unscale_

    def unscale_(optimizer: Any) -> None:
        unscale(optimizer)
        agree_on_overflow(scaler, optimizer, device)

    scaler.unscale_ = unscale_  # type: ignore[method-assign]
