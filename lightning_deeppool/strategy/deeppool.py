"""`DeepPoolStrategy`: DDP's process model with a burst-parallel plan instead of the DDP wrapper.

On the first training forward every rank traces the module, profiles its share of the layers, and
rank 0 plans; the plan is broadcast and installed: the module's forward is replaced by the runtime,
process groups are built and the optimizers keep only the parameters this rank owns. Rank 0 runs
every layer, so it holds every parameter and all optimizer state: checkpoints are written from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.utils import _pytree as pytree
from typing_extensions import override

from lightning_deeppool.planner.cache import default_cache_dir
from lightning_deeppool.planner.capture import CapturedGraph, capture_graph
from lightning_deeppool.planner.plan import Plan
from lightning_deeppool.planner.profile import Profile
from lightning_deeppool.planner.search import DEFAULT_EXEMPT_BELOW_S, search
from lightning_deeppool.strategy.agree import on_every_rank, on_rank_zero
from lightning_deeppool.strategy.amp import make_scaler_agree
from lightning_deeppool.strategy.groups import PlanGroups
from lightning_deeppool.strategy.idle import IdleWindows
from lightning_deeppool.strategy.profiling import profile_on_ranks
from lightning_deeppool.strategy.runtime import BurstRuntime
from lightning_deeppool.strategy.schedule import DEFAULT_BUCKET_BYTES, build_schedule

log = logging.getLogger(__name__)
# The private method of Lightning's training epoch loop that broadcasts the SIGTERM flag each step.
_SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"

PlanSource = str | Path | Mapping[str, int] | None


class DeepPoolStrategy(DDPStrategy):
    """Burst-parallel training: every layer runs on its own number of devices.

    Args:
        amplification_limit: a layer may use at most this many times the device-time it needs on one
            device (``time(w) * w <= limit * time(1)``); ``float("inf")`` disables the limit.
        plan: ``None`` plans automatically; a path loads a plan file; a mapping of module-name
            prefixes to widths pins those layers (``{"classifier": 1}``; ``""`` pins all).
        save_plan: where rank 0 writes the plan (default: ``<log_dir>/deeppool_plan.json``).
        module: name of the submodule whose forward is planned (default: the LightningModule).
        leaf_modules: submodules planned as single layers (for code torch.fx cannot trace).
        profile_warmup, profile_repeats: timing runs per layer and batch size (median of repeats).
        cache_dir: profile cache (default ``$DEEPPOOL_CACHE_DIR`` or ``~/.cache/lightning_deeppool``);
            ``False`` disables caching.
        exempt_below_s: layers faster than this at width 1 are exempt from the amplification limit.
        memory_budget_bytes: per-device memory budget where memory is profiled (CUDA).
        bucket_mb: gradient all-reduce bucket size.
    """

    strategy_name = "deeppool"

    def __init__(
        self,
        amplification_limit: float = 2.0,
        plan: PlanSource = None,
        save_plan: str | Path | None = None,
        module: str | None = None,
        leaf_modules: tuple[str, ...] | list[str] = (),
        profile_warmup: int = 2,
        profile_repeats: int = 5,
        cache_dir: str | Path | Literal[False] | None = None,
        exempt_below_s: float = DEFAULT_EXEMPT_BELOW_S,
        memory_budget_bytes: float | None = None,
        bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        if not amplification_limit >= 1.0:
            raise ValueError(f"amplification_limit must be >= 1 (or inf), got {amplification_limit}")
        if plan is not None and not isinstance(plan, str | Path | Mapping):
            raise TypeError(
                f"plan must be None, a plan file path or a mapping of pins, got {type(plan).__name__}"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.amplification_limit = float(amplification_limit)
        self.plan_source = dict(plan) if isinstance(plan, Mapping) else plan
        self.save_plan = save_plan
        self.module_name = module
        self.leaf_modules = tuple(leaf_modules)
        self.profile_warmup = profile_warmup
        self.profile_repeats = profile_repeats
        self.cache_dir = cache_dir
        self.exempt_below_s = exempt_below_s
        self.memory_budget_bytes = memory_budget_bytes
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.plan: Plan | None = None
        self.profile: Profile | None = None
        self.idle_windows = IdleWindows()
        self._runtime: BurstRuntime | None = None
        self._groups: PlanGroups | None = None
        self._target: nn.Module | None = None
        self._captured: CapturedGraph | None = None
        self._sync_gradients = True
        self._failed = False
        self._between_steps_loop: Any = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("deeppool", "popen"), ("deeppool_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"DeepPool burst-parallel strategy with start_method '{start_method}'",
                override=True,
                start_method=start_method,
            )

    # ------------------------------------------------------------------------------- lifecycle
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        if self._layer_sync is not None:
            raise ValueError(
                "Trainer(sync_batchnorm=True) is not supported with deeppool: layers run on different "
                "numbers of devices. Remove sync_batchnorm or use strategy='ddp'."
            )
        self._failed = False
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # The DDP wrapper would broadcast rank 0's weights; without it we do.
        _sync_module_states(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._replace_forward()
        self._agree_on_clipping()
        self._wait_between_steps_in_window(trainer)
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            make_scaler_agree(scaler, self.root_device)

    @override
    def on_train_end(self) -> None:
        # Ranks other than 0 skipped the updates of layers they do not run: give them the result.
        if self._runtime is not None and self.lightning_module is not None:
            _sync_module_states(self.lightning_module)

    @override
    def teardown(self) -> None:
        connected = dist.is_available() and dist.is_initialized()
        if connected and not self._failed and self.world_size > 1:
            # After a clean run, no rank destroys the plan's groups while a peer may still use them.
            dist.barrier()
        self._uninstall()
        self._restore_forward()
        self._restore_wait_between_steps()
        super().teardown()
        if self._start_method != "popen" and connected:
            # The worker process ends next; a live gloo group can abort it at exit.
            dist.destroy_process_group()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Say where in the burst schedule a failure (a collective timeout, say) happened."""
        self._failed = True
        action = self._runtime.last_action if self._runtime is not None else None
        if action is not None and hasattr(exception, "add_note"):
            exception.add_note(
                f"deeppool: rank {self.global_rank} was running action {action} of the plan's schedule"
            )

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip gradient all-reduces on accumulation steps; the last micro-batch syncs the sum.

        The flag is kept on the strategy too: the first micro-batch's forward installs the runtime
        inside this block, and that runtime must not sync either.
        """
        self._sync_gradients = False
        if self._runtime is not None:
            self._runtime.sync_gradients = False
        try:
            yield
        finally:
            self._sync_gradients = True
            if self._runtime is not None:
                self._runtime.sync_gradients = True

    @override
    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        def closure_then_check() -> Any:
            result = closure()
            self._check_installed()
            return result

        return super().optimizer_step(optimizer, closure_then_check, model, **kwargs)

    def _check_installed(self) -> None:
        """A training step that never ran the planned forward installed no plan: its gradients were
        not synchronized. Every rank ran the same step, so every rank raises here."""
        if self._runtime is not None or self.world_size < 2:
            return
        target = self._target if self._target is not None else self._planned_module()
        raise RuntimeError(
            f"deeppool: the training step did not call {type(target).__name__}.forward, so no plan was "
            "installed and gradients would not be synchronized across ranks. Call the model's forward "
            "in training_step (self(x)), or set DeepPoolStrategy(module='<name>') to the submodule "
            "training_step calls."
        )

    # ------------------------------------------------------------------------ forward takeover
    def _planned_module(self) -> nn.Module:
        module = self.lightning_module
        assert module is not None
        if self.module_name is None:
            return module
        try:
            return module.get_submodule(self.module_name)
        except AttributeError:
            names = [name for name, _ in module.named_children()]
            raise ValueError(
                f"DeepPoolStrategy(module={self.module_name!r}): {type(module).__name__} has no such "
                f"submodule; its children are {names}"
            ) from None

    def _replace_forward(self) -> None:
        target = self._planned_module()
        self._target = target
        original = type(target).forward.__get__(target)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._runtime is None and self._should_install():
                self._install(args, kwargs)
            if self._runtime is not None:
                return self._runtime.forward(*args, **kwargs)
            return original(*args, **kwargs)

        target.forward = forward  # type: ignore[method-assign]

    def _restore_forward(self) -> None:
        if self._target is not None and "forward" in vars(self._target):
            del self._target.forward
        self._target = None

    def _should_install(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or self.world_size < 2:
            return False
        return trainer.training or self.plan is not None or isinstance(self.plan_source, str | Path)

    # ----------------------------------------------------------------------------- planning
    def _install(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Capture, profile (or load), plan on rank 0, broadcast, and install on every rank."""
        target = self._target
        assert target is not None
        # Before capture: a rank without samples cannot trace, and must fail with the others.
        global_batch = self._global_batch_size(args, kwargs)
        captured = on_every_rank(lambda: capture_graph(target, args, kwargs, leaf_modules=self.leaf_modules))
        env = captured.bind(args, kwargs)
        if self.plan is None:
            self.plan = self._make_plan(captured, env, global_batch)
        self.plan.check_matches(captured.graph, self.world_size)
        self._activate(captured)

    def _global_batch_size(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Sum of the ranks' sample counts (tensor arguments are batches). Collective."""
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        counts: list[Any] = [None] * self.world_size
        with self.idle_windows.window("global_batch_size"):
            dist.all_gather_object(counts, leaves[0].shape[0] if leaves else 0)
        total = sum(counts)
        if total < self.world_size:
            raise ValueError(
                f"the global batch has {total} samples ({counts} per rank), fewer than the {self.world_size} "
                "devices: every device needs at least one sample. Increase the DataLoader batch_size."
            )
        return int(total)

    def _make_plan(self, captured: CapturedGraph, env: dict[str, Any], global_batch: int) -> Plan:
        if isinstance(self.plan_source, str | Path):
            path = Path(self.plan_source)
            plan = on_every_rank(lambda: Plan.load(path))
            plan.check_matches(captured.graph, self.world_size)
            return plan
        pins = self.plan_source if isinstance(self.plan_source, Mapping) else None
        cache_dir = None if self.cache_dir is False else Path(self.cache_dir or default_cache_dir())
        profile = profile_on_ranks(
            captured,
            env,
            global_batch,
            device=self.root_device,
            optimizers=self.optimizers,
            cache_dir=cache_dir,
            warmup=self.profile_warmup,
            repeats=self.profile_repeats,
        )
        self.profile = profile
        plan = on_rank_zero(
            lambda: search(
                captured.graph,
                profile,
                world_size=self.world_size,
                global_batch_size=global_batch,
                amplification_limit=self.amplification_limit,
                exempt_below_s=self.exempt_below_s,
                pins=pins,
                memory_budget_bytes=self.memory_budget_bytes,
            )
        )
        self._report(plan, self._plan_path())
        return plan

    def _report(self, plan: Plan, path: Path | None) -> None:
        if self.global_rank != 0:
            return
        print(plan.table(), flush=True)
        if path is not None:
            plan.save(path)
            print(f"deeppool: plan written to {path}", flush=True)

    def _plan_path(self) -> Path | None:
        """`save_plan`, else the run's log directory. Collective: `trainer.log_dir` broadcasts."""
        if self.save_plan:
            return Path(self.save_plan)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        log_dir = trainer.log_dir if trainer is not None else None
        return Path(log_dir) / "deeppool_plan.json" if log_dir else None

    def _activate(self, captured: CapturedGraph) -> None:
        """Build groups, the runtime and the pruned optimizers for `self.plan` (every rank)."""
        assert self.plan is not None and self.lightning_module is not None
        params = dict(captured.module.named_parameters())
        schedule = build_schedule(
            captured.graph,
            self.plan.widths(),
            captured.layer_params,
            {name: p.numel() * p.element_size() for name, p in params.items()},
            self.world_size,
            self.bucket_bytes,
        )
        planned = {id(p) for p in params.values()}
        unplanned = {
            f"<unplanned>.{name}": p
            for name, p in self.lightning_module.named_parameters()
            if id(p) not in planned and p.requires_grad
        }
        self._groups = PlanGroups([*schedule.param_widths.values(), self.world_size], self.world_size)
        self._runtime = BurstRuntime(
            captured,
            schedule,
            rank=self.global_rank,
            device=self.root_device,
            groups=self._groups,
            params={**params, **unplanned},
            unplanned=list(unplanned),
            idle=self.idle_windows,
            redistribution=self._groups.redistribution,
        )
        self._runtime.sync_gradients = self._sync_gradients
        self._captured = captured
        owner = {id(p): schedule.param_widths.get(name, self.world_size) for name, p in params.items()}
        _prune_optimizers(self.optimizers, lambda p: self.global_rank < owner.get(id(p), self.world_size))

    def _uninstall(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
        if self._groups is not None:
            self._groups.destroy()
        self._groups = None
        self._runtime = None
        self._captured = None

    # --------------------------------------------------------------------------- idle windows
    def _wait_between_steps_in_window(self, trainer: pl.Trainer) -> None:
        """Lightning's training loop broadcasts rank 0's SIGTERM flag before every step; a rank that
        finished its part of the step early waits there for rank 0, idle like any wait in the plan."""
        loop = trainer.fit_loop.epoch_loop
        broadcast = getattr(loop, _SIGTERM_BROADCAST, None)
        if broadcast is None:
            return
        windows = self.idle_windows

        def broadcast_in_window() -> None:
            with windows.window("between_steps"):
                broadcast()

        setattr(loop, _SIGTERM_BROADCAST, broadcast_in_window)
        self._between_steps_loop = loop

    def _restore_wait_between_steps(self) -> None:
        loop, self._between_steps_loop = self._between_steps_loop, None
        if loop is not None and _SIGTERM_BROADCAST in vars(loop):
            delattr(loop, _SIGTERM_BROADCAST)

    # ------------------------------------------------------------------------------ clipping
    def _agree_on_clipping(self) -> None:
        """Clip by the global norm: rank 0 holds every gradient, so its norm is the global one."""
        plugin = self.precision_plugin
        main_params: Callable[[Any], Any] = plugin.main_params

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            grads = [p for p in main_params(optimizer) if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in grads]) if grads else torch.zeros(())
            norm = norm.to(self.root_device, torch.float32)
            if self._runtime is not None:
                with self.idle_windows.window("clip_norm"):
                    dist.broadcast(norm, src=0)
            torch.nn.utils.clip_grads_with_norm_(grads, clip_val, norm)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]


def _prune_optimizers(optimizers: list[Any], keep: Callable[[nn.Parameter], bool]) -> None:
    """Drop the parameters this rank does not own from every param group, in place (so LR
    schedulers, which hold the groups, keep working), with their state and gradients."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            dropped = [p for p in group["params"] if not keep(p)]
            group["params"][:] = [p for p in group["params"] if keep(p)]
            for p in dropped:
                optimizer.state.pop(p, None)
                p.grad = None
