"""What the strategy adds around Lightning's hooks so that user code sees what DDP gives it: whether
user code reads gradients, the refresh before evaluation, and the errors raised where a hook read what
a rank does not hold."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_deeppool.install import InstalledPlan


def check_decision(
    decision: bool, metrics: Mapping[str, Any], installed: InstalledPlan, hook: str | None
) -> None:
    """Raise on every rank if the ranks decided differently (a callback's reduced stop or save
    decision) while ranks that do not hold every layer hold non-finite logged values: values computed
    from weights they do not keep current (logged between refreshes, such values stay in the callback
    metrics), which would otherwise stop or save silently unlike DDP. Collective; called on every rank
    under a plan with layers below full width."""
    nonfinite = sorted(
        name
        for name, value in metrics.items()
        if isinstance(value, torch.Tensor) and not bool(torch.isfinite(value).all())
    )
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (bool(decision), nonfinite))
    if len({decided for decided, _ in every}) == 1:
        return
    suspects = {r: names for r, (_, names) in enumerate(every) if names and not installed.owns_everything(r)}
    if suspects:
        found = "; ".join(f"rank {r}: {names[:6]}" for r, names in suspects.items())
        raise RuntimeError(
            f"deeppool: the ranks decided differently in {hook or 'a callback'} (EarlyStopping or "
            f"ModelCheckpoint, say) while ranks that do not run every layer logged values that are not "
            f"finite ({found}): values computed from weights of layers they do not run, which hold NaN "
            "there between refreshes. Log such values with sync_dist=True, compute them in "
            "validation_step, which runs after every rank gets rank 0's weights, or set "
            "DeepPoolStrategy(current_weights=True) to keep every rank's weights current"
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


class HoldReleasedWeights(pl.Callback):
    """First of the callbacks: gives every rank storage again for the weights it released (NaN until
    the refresh that follows the other callbacks' epoch hooks) before any callback writes weights in
    place, as weight averaging does at each evaluation epoch's start and where training ends."""

    def __init__(self, hold: Callable[[], None]) -> None:
        self.hold = hold

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.hold()

    @override
    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.hold()

    @override
    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.hold()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.hold()


def lost_connection(exception: BaseException) -> bool:
    """Whether a peer closed its connections (it stopped): gloo's, the store's and `LocalLinks`' wording."""
    text = str(exception).lower()
    closed = ("broken pipe", "connection closed", "connection reset", "closed its link")
    return isinstance(exception, ConnectionError) or any(words in text for words in closed)
