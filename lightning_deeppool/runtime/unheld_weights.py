"""The weights of layers a rank does not run hold no memory there during training.

No rank keeps those weights current (it has no gradients or optimizer state for them), so from its
first optimizer step until the next refresh each one is a placeholder: a NaN scalar expanded to the
parameter's shape (stride 0, one element of storage). A placeholder rather than a tensor subclass that
raises on read, because:

- every read sees NaN, as those weights held before they were released, so the checks built on it
  stop every rank together (a NaN reduced across ranks names the parameters and the ranks that read
  them), where a read that raised would stop the reading rank alone while the others wait for it in
  their next collective;
- it is a plain tensor: `state_dict`, deep copies (weight averaging), the model summary, moves and
  Lightning's checkpoint dump on every rank work as before (rank 0, which holds every parameter,
  writes checkpoints);
- a write into it raises (torch refuses writes to elements that share memory), so no rank updates a
  weight it does not hold without an error.
"""

from __future__ import annotations

import torch
from torch import nn

# torch's error for a write into a placeholder (the strategy adds a note naming the weights)
WRITE_ERROR = "more than one element of the written-to tensor refers to a single memory location"


def release(param: nn.Parameter) -> bool:
    """Replace `param`'s data by a placeholder, freeing its storage (where nothing else refers to it);
    False, with nothing changed, for a parameter that cannot hold NaN or is too small to matter."""
    if not param.is_floating_point() or param.numel() <= 1:
        return False
    nan = torch.full((), float("nan"), dtype=param.dtype, device=param.device)
    param.data = nan.expand(param.shape)
    return True


def hold(param: nn.Parameter) -> None:
    """Give a released `param` storage of its own again, NaN-filled (a refresh writes rank 0's values)."""
    param.data = param.data.clone(memory_format=torch.contiguous_format)


def write_note(exception: BaseException, released: list[str], rank: int) -> str | None:
    """What to add to `exception` where it is torch's refusal to write into a placeholder, while this
    rank (`rank`) has `released` parameters; else None."""
    if not released or WRITE_ERROR not in str(exception):
        return None
    return (
        f"deeppool: rank {rank} holds no storage for the weights of the layers it does not run "
        f"({released[:6]}) between its first optimizer step and the next refresh (validation, the end of "
        "fit), so writing them in place fails there. Write such weights on rank 0 only "
        "(`if trainer.is_global_zero:`), which holds every parameter, or set "
        "DeepPoolStrategy(current_weights=True) to keep them on every rank"
    )
