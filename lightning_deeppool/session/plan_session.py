"""The plan's state on this rank, in one object the strategy creates and hands to `ForwardCalls`.

The strategy owns a `PlanSession` for its lifetime: a plan and its profile outlive a fit (the next fit
reuses them), the installed plan lives from the first planned call of a fit to its teardown. What a
fit gives the plan (the LightningModule, its device, this rank, the optimizers, the log directory) is
handed in once per fit (`begin_fit`), so nothing here reads the strategy back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_deeppool.install import Compiler, InstalledPlan, PlanOptions, capture_shape, install
from lightning_deeppool.ir.profile import Profile
from lightning_deeppool.planner.plan import Plan
from lightning_deeppool.runtime.idle import IdleWindows
from lightning_deeppool.session.modules import sync_buffers
from lightning_deeppool.session.step_times import StepTimes


@dataclass(frozen=True)
class Fit:
    """What a fit gives the plan. `optimizers` is read when needed (a tuner may swap them); `log_dir`
    is collective (Lightning broadcasts it)."""

    root: nn.Module
    device: torch.device
    rank: int
    optimizers: Callable[[], Sequence[torch.optim.Optimizer]]
    log_dir: Callable[[], str | None]
    reads_gradients: bool = False  # a hook after backward or before the optimizer step, or clipping
    compiler: Compiler | None = None  # `fit` was given the LightningModule compiled, or compile_layers


class PlanSession:
    """How this strategy plans, what it planned, what is installed for the current fit, and the step
    times the plan is judged by."""

    def __init__(self, options: PlanOptions, idle: IdleWindows) -> None:
        self.options = options
        self.idle = idle
        self.step_times = StepTimes()
        self.plan: Plan | None = None
        self.profile: Profile | None = None  # what `plan` was made from (None when it was given)
        self.installed: InstalledPlan | None = None
        self._fit: Fit | None = None

    @property
    def fit(self) -> Fit:
        if self._fit is None:
            raise RuntimeError("deeppool: no fit has begun (the strategy's setup has not run)")
        return self._fit

    def begin_fit(self, fit: Fit) -> None:
        self._fit = fit

    def install(self, target: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> InstalledPlan:
        """Capture, plan and install on every rank (collective): the first planned call's work."""
        fit = self.fit
        self.installed = install(
            self.options,
            fit.root,
            target,
            args,
            kwargs,
            device=fit.device,
            optimizers=fit.optimizers(),
            idle=self.idle,
            log_dir=fit.log_dir,
            plan=self.plan,
            reads_gradients=fit.reads_gradients,
            compiler=fit.compiler,
        )
        self.plan = self.installed.plan
        if self.installed.profile is not None:
            self.profile = self.installed.profile
        self.step_times.restart()
        return self.installed

    def capture_shape(
        self,
        installed: InstalledPlan,
        target: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        src: int | None = None,
    ) -> None:
        """Capture the planned forward for this call's new per-sample shapes or module values (rank
        `src`'s call's, if given) and run `installed` (this fit's plan) on it (collective). Every rank
        gets rank 0's buffers first, as DDP gives them before each forward: a module put in eval()
        reads running statistics each rank updated on its own samples until then."""
        sync_buffers(self.fit.root)
        capture_shape(self.options, installed, target, args, kwargs, self.fit.compiler, src)

    def sync(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Reduce fresh gradients (of `optimizer`'s parameters, if given). Collective."""
        if self.installed is not None:
            self.installed.sync(self.fit.optimizers(), optimizer)

    def global_norm(self, grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """The `norm_type`-norm of `grads` to clip by, the same on every rank: rank 0 holds every
        gradient, so its norm is the global one (collective once installed)."""
        norm = torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.zeros(())
        norm = norm.to(self.fit.device, torch.float32)
        if self.installed is not None:
            with self.idle.window("clip_norm"):
                dist.broadcast(norm, src=0)
        return norm

    def end_fit(self) -> None:
        """Uninstall: the plan's groups, hooks and links are released; the plan is kept."""
        if self.installed is not None:
            self.installed.close()
            self.installed = None
        self._fit = None
