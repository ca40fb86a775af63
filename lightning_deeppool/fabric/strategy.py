"""`DeepPoolStrategy` for Lightning Fabric: Fabric's DDP process model with the burst-parallel plan in
place of the DDP wrapper, for training loops written by hand.

The module given to `fabric.setup` is the planned one. A call of it with gradients enabled opens a step
(a no-grad call outside one runs the module's own forward, as evaluation does); every call of the step
that every rank makes runs the plan, and the first installs it, as in the Trainer's strategy (both share
`session/`). The step ends where the optimizer steps. `fabric.backward` synchronizes the gradients it
produced unless `fabric.no_backward_sync` blocks it. Rank 0 runs every layer and holds every parameter
and all optimizer state, so `fabric.save` writes whole checkpoints from it; another rank's copy of the
layers it does not run goes stale at each optimizer step and is refreshed from rank 0 by `model.eval()`
(called on every rank) and by `fabric.load`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _PATH, Optimizable, ReduceOp
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_deeppool.comm.messages import SmallGather
from lightning_deeppool.ir.profile import Profile
from lightning_deeppool.planner.plan import Plan
from lightning_deeppool.planner.search import DEFAULT_EXEMPT_BELOW_S
from lightning_deeppool.runtime.idle import IdleWindows
from lightning_deeppool.session.call_agreement import CallAgreement, meeting
from lightning_deeppool.session.forward_calls import ForwardCalls
from lightning_deeppool.session.modules import patch_scaler_overflow, planned_submodule, sync_module_states
from lightning_deeppool.session.options import (
    DEFAULT_BUCKET_MB,
    PlanSource,
    check_every,
    compile_options,
    layer_compiler,
    plan_options,
    register_names,
)
from lightning_deeppool.session.plan_session import Fit, PlanSession
from lightning_deeppool.session.reads import checked_reduction


class DeepPoolStrategy(DDPStrategy):
    """Burst-parallel training for Fabric loops: every layer runs on its own number of devices.

    Takes the Trainer strategy's arguments (`lightning_deeppool.DeepPoolStrategy`) with the same
    meaning, except those of Lightning's loops. ``module`` names the submodule whose forward is
    planned (default: the module given to ``fabric.setup``); one module is planned per strategy.
    """

    strategy_name = "deeppool"

    def __init__(
        self,
        amplification_limit: float = 2.0,
        plan: PlanSource = None,
        save_plan: str | Path | None = None,
        module: str | None = None,
        leaf_modules: tuple[str, ...] | list[str] = (),
        granularity: Literal["layer", "module"] = "layer",
        profile_warmup: int = 2,
        profile_repeats: int = 5,
        cache_dir: str | Path | Literal[False] | None = None,
        exempt_below_s: float = DEFAULT_EXEMPT_BELOW_S,
        memory_budget_bytes: float | None = None,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        shared_batch: bool = False,
        check_every_n_steps: int = 100,
        compile_layers: bool | Mapping[str, Any] = False,
        branches: bool = True,
        current_weights: bool = False,
        gradient_as_bucket_view: bool | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable[..., Any] | None = None,
        ddp_comm_wrapper: Callable[..., Any] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        options = plan_options(
            amplification_limit=amplification_limit,
            plan=plan,
            save_plan=save_plan,
            leaf_modules=leaf_modules,
            granularity=granularity,
            profile_warmup=profile_warmup,
            profile_repeats=profile_repeats,
            cache_dir=cache_dir,
            exempt_below_s=exempt_below_s,
            memory_budget_bytes=memory_budget_bytes,
            bucket_mb=bucket_mb,
            shared_batch=shared_batch,
            branches=branches,
            current_weights=current_weights,
            gradient_as_bucket_view=gradient_as_bucket_view,
            ddp_kwargs=kwargs,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.module_name = module
        self.check_every_n_steps = check_every(check_every_n_steps)
        self.compile_layers = compile_options(compile_layers)
        self.idle_windows = IdleWindows()
        self.session = PlanSession(options, self.idle_windows)
        self._backward_sync_control = _BlockGradientSync(self)
        self._calls: ForwardCalls | None = None
        self._gather: SmallGather | None = None  # where the ranks meet (`CallAgreement`)
        self._optimizers: list[Optimizer] = []
        self._sync_gradients = True
        self._steps = 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """With a shared batch every rank reads all the data, in the same order."""
        if self.session.options.shared_batch:
            return {"num_replicas": 1, "rank": 0}
        return super().distributed_sampler_kwargs

    @property
    def plan(self) -> Plan | None:
        """The installed plan (None before the first planned call)."""
        return self.session.plan

    @property
    def profile(self) -> Profile | None:
        """The profile the plan was made from (None when the plan was given)."""
        return self.session.profile

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(cls, strategy_registry)

    # --------------------------------------------------------------------------------- setup
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]
        """The module itself (no wrapper), rank 0's weights on every rank, its forward taken over."""
        if self._calls is not None:
            raise RuntimeError(
                "deeppool: fabric.setup was given a second module; DeepPoolStrategy plans one module per "
                "Fabric. Put the models trained together in one nn.Module, or use strategy='ddp'"
            )
        sync_module_states(module)  # what the DDP wrapper's constructor does
        scaler = getattr(self.precision, "scaler", None)
        if scaler is not None:
            patch_scaler_overflow(scaler, self.root_device)
        self.session.begin_fit(
            Fit(
                module,
                self.root_device,
                self.global_rank,
                lambda: self._optimizers,
                self._log_dir,
                reads_gradients=True,  # the loop is the user's: it may read any gradient before a step
                compiler=layer_compiler(self.compile_layers),
            )
        )
        target = planned_submodule(module, self.module_name)
        self._calls = ForwardCalls(self.session, target, self._agreement(), torch.is_grad_enabled)
        # Fabric compiles the module given to setup compiled again around this forward: it must run
        # eagerly (its layers compile with `compile_layers`).
        target.forward = torch.compiler.disable(target.forward)  # type: ignore[method-assign]
        _refresh_on_eval(module, self._refresh)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self._optimizers.append(optimizer)
        return optimizer

    def _agreement(self) -> CallAgreement | None:
        agreement, self._gather = meeting(self.world_size, self.global_rank, self._timeout)
        return agreement

    def _log_dir(self) -> str | None:
        return None  # Fabric has no run directory: the plan is written to `save_plan` only

    # ------------------------------------------------------------------------------ the step
    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward, then the gradients it produced synchronized, unless `no_backward_sync` blocks it."""
        if self._calls is None:
            return super().backward(tensor, module, *args, **kwargs)
        with self._calls.backward(last=self._sync_gradients):
            super().backward(tensor, module, *args, **kwargs)
        if self._sync_gradients:
            self._calls.sync_gradients()
        return None

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Backward passes inside leave their gradients unsynchronized; the next one outside syncs the sum."""
        self._sync_gradients = False
        try:
            yield
        finally:
            self._sync_gradients = True

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """The step ends: the ranks meet, fresh gradients are synchronized, the optimizer steps."""
        calls = self._calls
        if calls is None:
            return super().optimizer_step(optimizer, **kwargs)
        calls.end_step()
        calls.check_installed()
        calls.sync_gradients(optimizer)  # type: ignore[arg-type]
        output = super().optimizer_step(optimizer, **kwargs)
        calls.after_optimizer_step()
        self._steps += 1
        every = self.check_every_n_steps
        if every and self._steps % every == 0:
            with self._collective("replica check"):
                calls.check_replicas()
        return output

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the norm of every gradient, rank 0's (which holds them all), the same on every rank."""
        self.precision.unscale_gradients(optimizer)
        params = [p for p in self.precision.main_params(optimizer) if p.grad is not None]
        norm = self.session.global_norm([p.grad for p in params], float(norm_type))  # type: ignore[misc]
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                "anyway, set `error_if_nonfinite=False`"
            )
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def _refresh(self) -> None:
        """Every rank's parameters and buffers rank 0's (`ForwardCalls.refresh`), where a plan is
        installed. Collective."""
        if self._calls is not None and self.session.installed is not None:
            with self._collective("refresh of parameters at model.eval()"):
                self._calls.refresh()

    # ---------------------------------------------------------------------------- checkpoints
    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Fabric's load on every rank; under an installed plan, every rank's weights are made whole
        first and each optimizer loads every parameter's state, then drops again what its rank does
        not hold. Collective."""
        installed = self.session.installed
        if installed is None:
            return super().load_checkpoint(path, state, strict, weights_only)
        self._refresh()
        with installed.whole_optimizers(self._optimizers):
            return super().load_checkpoint(path, state, strict, weights_only)

    # ----------------------------------------------------------------------------- collectives
    @contextmanager
    def _collective(self, issued: str) -> Generator[None, None, None]:
        """Where the ranks meet (`CallAgreement`), they first check every rank issues this collective."""
        agreement = self._calls.agreement if self._calls is not None else None
        if agreement is not None:
            agreement.before_collective(f"fabric ({issued})")
        yield

    @override
    def all_reduce(
        self, tensor: torch.Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> torch.Tensor:
        ddp_all_reduce = super().all_reduce

        def reduce() -> torch.Tensor:
            with self._collective("all_reduce"):
                return ddp_all_reduce(tensor, group, reduce_op)

        return checked_reduction(tensor, self._unheld(), reduce, lambda: "fabric.all_reduce")

    def _unheld(self) -> Callable[[int], list[str]] | None:
        """The parameters each rank holds as NaN under the installed plan; None where every rank's are
        current."""
        installed = self.session.installed
        if installed is None or not installed.narrow or self.session.options.current_weights:
            return None
        return installed.not_held

    @override
    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        with self._collective("all_gather"):
            return super().all_gather(tensor, group, sync_grads)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self._collective("broadcast"):
            return super().broadcast(obj, src)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with self._collective("barrier"):
            super().barrier(*args, **kwargs)

    @override
    def teardown(self) -> None:
        """Uninstall the plan (its groups and links); the module keeps its own forward."""
        if self._calls is not None:
            self._calls.close()
            self._calls = None
        if self._gather is not None:
            self._gather.close()
            self._gather = None
        self.session.end_fit()
        super().teardown()


class _BlockGradientSync(_BackwardSyncControl):
    """`fabric.no_backward_sync`: backward passes inside leave their gradients to the next sync."""

    def __init__(self, strategy: DeepPoolStrategy) -> None:
        self.strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[None]:
        return self.strategy.block_backward_sync() if enabled else nullcontext()


def _refresh_on_eval(module: nn.Module, refresh: Callable[[], None]) -> None:
    """`module.eval()` (`train(False)`, which Fabric's wrapper passes on) refreshes first."""
    own = type(module).train

    def train(mode: bool = True) -> nn.Module:
        if not mode:
            refresh()
        return own(module, mode)

    module.train = train  # type: ignore[method-assign]
