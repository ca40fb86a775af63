"""What the strategy adds around Lightning's hooks so that user code sees what DDP gives it: whether
user code reads gradients, the refresh before evaluation, and the errors raised where a hook read what
a rank does not hold."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_deeppool.install import InstalledPlan


def check_reduced(
    tensor: torch.Tensor, result: torch.Tensor, installed: InstalledPlan, hook: str | None
) -> None:
    """Raise on every rank if a value reduced across ranks (`result`, the same on every rank) is not
    finite because a rank computed it (`tensor`) from layers it does not run, which hold NaN there
    between refreshes. Every rank takes the same branch; a host sync, only while such layers are NaN."""
    if bool(torch.isfinite(result).all()):
        return
    mine = not bool(torch.isfinite(tensor).all())
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    readers = [r for r, bad in enumerate(every) if bad and not installed.owns_everything(r)]
    if readers:
        rank = readers[0]
        raise RuntimeError(
            f"deeppool: a value reduced across ranks in {hook or 'a hook'} (self.log(..., sync_dist=True), "
            f"say) is NaN because ranks {readers} computed it from parameters of layers they do not run: "
            f"rank {rank} does not hold {installed.not_held(rank)[:6]}, which no rank keeps current "
            "there between refreshes (they hold NaN until validation or the end of fit). Compute "
            "such values on rank 0, which holds every parameter (self.log(..., rank_zero_only=True) "
            "or `if self.trainer.is_global_zero:`), or pin those layers to every device"
        )


# Hooks that see gradients after they are synchronized: where the user reads them.
_GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def reads_gradients(trainer: pl.Trainer, module: pl.LightningModule) -> bool:
    """Whether user code may read gradients: a gradient hook or gradient clipping of its own in the
    module or a callback, or manual optimization."""
    if not module.automatic_optimization:
        return True
    hooks = (*_GRADIENT_HOOKS, "configure_gradient_clipping")
    if any(is_overridden(hook, module, pl.LightningModule) for hook in hooks):
        return True
    return any(is_overridden(hook, c, pl.Callback) for c in callbacks(trainer) for hook in _GRADIENT_HOOKS)


def callbacks(trainer: pl.Trainer) -> list[pl.Callback]:
    return trainer.callbacks  # type: ignore[attr-defined,no-any-return]


class RefreshForEvaluation(pl.Callback):
    """Refreshes every rank's parameters at the start of each evaluation epoch, after the other
    callbacks' hooks (weight averaging swaps its weights in there): evaluation runs every layer on
    every rank."""

    def __init__(self, refresh: Callable[[], None]) -> None:
        self.refresh = refresh

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.refresh()

    @override
    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.refresh()

    @override
    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.refresh()


def lost_connection(exception: BaseException) -> bool:
    """Whether a peer closed its connections (it stopped): gloo's, the store's and `LocalLinks`' wording."""
    text = str(exception).lower()
    closed = ("broken pipe", "connection closed", "connection reset", "closed its link")
    return isinstance(exception, ConnectionError) or any(words in text for words in closed)
