"""What a rank reads of the weights it does not hold: the error that says so where such a read reaches
every rank through a reduction."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def checked_reduction(
    tensor: Any,
    not_held: Callable[[int], list[str]] | None,
    reduce: Callable[[], Any],
    hook: Callable[[], str | None],
) -> Any:
    """`reduce()` of `tensor` (a collective every rank issues), checked by `check_reduced` in the
    `hook` it is issued from where ranks hold parameters they do not run as NaN (`not_held` given)."""
    # Taken before the reduction, which may write its result into `tensor`.
    finite = torch.isfinite(tensor).all() if not_held and isinstance(tensor, torch.Tensor) else None
    result = reduce()
    if not_held is not None and finite is not None and isinstance(result, torch.Tensor):
        check_reduced(finite, result, not_held, hook())
    return result


def check_reduced(
    finite: torch.Tensor, result: torch.Tensor, not_held: Callable[[int], list[str]], hook: str | None
) -> None:
    """Raise on every rank if a value reduced across ranks (`result`, the same on every rank) is not
    finite because a rank computed it (its value before the reduction was `finite`, or not) from the
    parameters it does not hold (`not_held`), which hold NaN there between refreshes (as does any copy
    taken of them then), while rank 0's, which holds every parameter, is finite. Every rank takes the
    same branch; a host sync, under plans with such layers."""
    if bool(torch.isfinite(result).all()):
        return
    mine = not bool(finite)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    readers = [r for r, bad in enumerate(every) if bad and not_held(r)]
    if readers and not every[0]:
        unheld = "; ".join(f"rank {r} does not hold {not_held(r)[:6]}" for r in readers)
        raise RuntimeError(
            f"deeppool: a value reduced across ranks in {hook or 'a hook'} (self.log(..., sync_dist=True), "
            f"say) is NaN because ranks {readers} computed it from parameters of layers they do not run "
            f"({unheld}), or from a copy of them (an EMA of the weights, say): those ranks hold them as "
            "NaN between each optimizer step and the next refresh (validation and the end of fit under "
            "the Trainer, model.eval() under Fabric). Set "
            "DeepPoolStrategy(current_weights=True) to send them to every rank after each optimizer "
            "step, or compute such values on rank 0, which holds every parameter "
            "(self.log(..., rank_zero_only=True), `if trainer.is_global_zero:`, `if fabric.is_global_zero:`)"
        )
