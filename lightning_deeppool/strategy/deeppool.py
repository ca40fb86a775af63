"""`DeepPoolStrategy`: DDP's process model with a burst-parallel plan instead of the DDP wrapper.

Calls of the model inside `training_step` that every rank makes run the plan (`forward_calls`); the
first one captures the module, profiles it, plans on rank 0 and installs the plan on every rank:
process groups, the runtime, and gradient synchronisation at the end of each backward (and before
each optimizer step). Every other call runs as plain PyTorch on the rank that makes it. Rank 0 runs
every layer, so it holds every parameter and all optimizer state: checkpoints are written from it.
"""

from __future__ import annotations

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
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn
from typing_extensions import override

from lightning_deeppool.comm.messages import SmallGather
from lightning_deeppool.ir.profile import Profile
from lightning_deeppool.planner.plan import Plan
from lightning_deeppool.planner.search import DEFAULT_EXEMPT_BELOW_S
from lightning_deeppool.runtime.idle import IdleWindows
from lightning_deeppool.runtime.unheld_weights import write_note
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
from lightning_deeppool.session.step_times import summary
from lightning_deeppool.strategy.hooks import (
    HoldReleasedWeights,
    RefreshForEvaluation,
    callbacks,
    check_decision,
    lost_connection,
    reads_gradients,
)
from lightning_deeppool.strategy.patches import (
    clip_by_global_norm,
    optimizers_to_device,
    replace_wait_between_steps,
    take_compiler,
)


class DeepPoolStrategy(DDPStrategy):
    """Burst-parallel training: every layer runs on its own number of devices.

    Args:
        amplification_limit: a layer may use at most this many times the device-time it needs on one
            device (``time(w) * w <= limit * time(1)``); ``float("inf")`` disables the limit.
        plan: ``None`` plans automatically; a path loads a plan file; a mapping of module-name
            prefixes to placements pins those layers: a width (``{"classifier": 1}``; ``""`` pins
            all), ``{"width": 4, "spatial": 2}`` (samples split by height) or ``{"ranks": [2, 3]}``.
        save_plan: where rank 0 writes the plan (default: ``<log_dir>/deeppool_plan.json``).
        module: name of the submodule whose forward is planned (default: the LightningModule).
        leaf_modules: submodules planned as single layers and run as Python at every step (for code
            capture cannot follow).
        granularity: ``"layer"`` (operations without parameters join the layer they follow) or
            ``"module"`` (every submodule call is a layer of its own).
        profile_warmup, profile_repeats: timing runs per layer and batch size (median of repeats).
        cache_dir: profile cache (default ``$DEEPPOOL_CACHE_DIR`` or ``~/.cache/lightning_deeppool``);
            ``False`` disables caching.
        exempt_below_s: layers faster than this at width 1 are exempt from the amplification limit.
        memory_budget_bytes: per-device memory budget in bytes for the plan's estimated peak on every rank.
        bucket_mb: gradient all-reduce bucket size.
        shared_batch: every rank's DataLoader yields the same batch, which is the global batch (the
            strategy's sampler does not shard the data); each rank keeps its share of the samples for
            the plan and gets the whole batch's outputs back, so every rank computes one device's loss.
            This trains batches smaller than the device count, on layers the plan splits by height.
        check_every_n_steps: every this many steps, and at the end of fit, the ranks that train a
            parameter together compare their copies and raise on a difference (0: at the end only).
        compile_layers: run every planned layer's forward and backward compiled by ``torch.compile``:
            ``True`` with its defaults, or a mapping of its keyword arguments (``{"mode":
            "reduce-overhead"}`` replays each layer as a CUDA graph on GPUs). A model given to ``fit``
            compiled, or a compiled submodule, keeps its own compiler for its layers.
        branches: the automatic plan may run independent branches (an Inception block's, a two-tower
            model's towers) side by side on disjoint sets of devices; ``False`` keeps every layer on
            devices 0..width-1.
        current_weights: after each optimizer step, rank 0 sends every rank the weights of the layers
            that rank does not run, so that user code reading weights on every rank (a hand-written EMA,
            a weight norm logged with ``sync_dist=True``) sees DDP's values; off, those weights hold NaN
            there between refreshes (the plan's footer prints what it sends).
        gradient_as_bucket_view: DDP's: gradients are views into their all-reduce bucket (``None``,
            deeppool's default: ``True``); ``False`` keeps each gradient in its own tensor.
        ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper: ``DDPStrategy``'s communication hook, applied
            to each of deeppool's gradient buckets with the bucket's own process group, on every
            device (Lightning's DDP applies it on CUDA only).
        model_averaging_period, **kwargs: the rest of ``DDPStrategy``'s options and the
            ``DistributedDataParallel`` arguments it forwards (``find_unused_parameters``,
            ``static_graph``, ``bucket_cap_mb``, ...): honoured, accepted or refused as the README's
            "Switching from DDP" says.
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
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable[..., Any] | None = None,
        ddp_comm_wrapper: Callable[..., Any] | None = None,
        model_averaging_period: int | None = None,
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
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,  # LightningCLI resolves them through DDPStrategy to DistributedDataParallel
        )
        self.module_name = module
        self.idle_windows = IdleWindows()
        self.session = PlanSession(options, self.idle_windows)
        self._calls: ForwardCalls | None = None
        self._gather: SmallGather | None = None  # where the ranks meet (`CallAgreement`)
        self._sync_gradients = True
        self._failed = False
        self._restore_between_steps: Callable[[], None] | None = None
        self.check_every_n_steps = check_every(check_every_n_steps)
        self.compile_layers = compile_options(compile_layers)
        self._checked_at = 0
        self._refresh_for_evaluation = RefreshForEvaluation(self._refresh_parameters)
        self._hold_released = HoldReleasedWeights(self._hold_unheld)
        self._trainer_callbacks: list[pl.Callback] = []
        self._failed_collective: str | None = None  # the hook that issued a collective that failed
        self._unheld_after_fit: dict[int, list[str]] = {}  # see `_unheld`
        self.measured_step_time_s: float | None = None
        self.measured_work_time_s: float | None = None  # the plan's part of it (see `report`)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """With a shared batch every rank reads all the data, in the same order."""
        if self.session.options.shared_batch:
            return {"num_replicas": 1, "rank": 0}
        return super().distributed_sampler_kwargs

    @property
    def plan(self) -> Plan | None:
        """The plan installed in this fit, or the last fit's (None before the first planned call)."""
        return self.session.plan

    @property
    def profile(self) -> Profile | None:
        """The profile the plan was made from (None when the plan was given)."""
        return self.session.profile

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(cls, strategy_registry)

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
        self._failed_collective = None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # The DDP wrapper would broadcast rank 0's weights; without it we do.
        sync_module_states(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
        assert self.lightning_module is not None
        self.session.begin_fit(
            Fit(
                self.lightning_module,
                self.root_device,
                self.global_rank,
                lambda: self.optimizers,
                self._log_dir,
                reads_gradients=reads_gradients(trainer, self.lightning_module),
                compiler=take_compiler(self.lightning_module) or layer_compiler(self.compile_layers),
            )
        )
        self._calls = ForwardCalls(self.session, self._planned_module(), self._agreement())
        clip_by_global_norm(self.precision_plugin, self.session.global_norm)
        self._restore_between_steps = replace_wait_between_steps(
            trainer.fit_loop.epoch_loop, self._between_steps
        )
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            patch_scaler_overflow(scaler, self.root_device)
        self._trainer_callbacks = callbacks(trainer)
        self._trainer_callbacks.append(self._refresh_for_evaluation)  # last: after the user's epoch hooks
        self._trainer_callbacks.insert(0, self._hold_released)  # first: before any callback writes weights

    def _agreement(self) -> CallAgreement | None:
        agreement, self._gather = meeting(self.world_size, self.global_rank, self._timeout)
        return agreement

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.session.step_times.mark()
        step = self.lightning_module.trainer.global_step if self.lightning_module is not None else 0
        every = self.check_every_n_steps
        if every and step and step % every == 0 and step != self._checked_at:
            self._checked_at = step
            with self._collective("replica check", hook="on_train_batch_start"):
                self._check_replicas()

    @override
    def on_train_end(self) -> None:
        installed = self.session.installed
        if installed is None:
            return
        self._refresh_parameters("the end of training")
        step_times = self.session.step_times
        self.measured_step_time_s = step_times.median_s()
        self.measured_work_time_s = step_times.median_work_s()
        if self.global_rank == 0:
            plan = installed.plan
            steps = len(step_times.seconds)
            print(
                summary(
                    self.measured_step_time_s, self.measured_work_time_s, plan.predicted_step_time_s, steps
                )
            )

    def _refresh_parameters(self, where: str = "before evaluation") -> None:
        """`ForwardCalls.refresh`, issued `where`: a rank still in a collective of a hook of its own
        stops every rank, naming both."""
        if self.session.installed is None or self._calls is None:
            return
        with self._collective("refresh of parameters", hook=where):
            self._calls.refresh()

    def _hold_unheld(self) -> None:
        if self.session.installed is not None:
            self.session.installed.hold_unheld()

    def _check_replicas(self) -> None:
        if self._calls is not None:
            self._calls.check_replicas()

    @override
    def teardown(self) -> None:
        connected = dist.is_available() and dist.is_initialized()
        if connected and not self._failed and self.world_size > 1:
            # After a clean run, no rank destroys the plan's groups while a peer may still use them;
            # where the ranks meet, a peer still in a collective of its own stops both.
            with self._collective("barrier", hook="the end of fit"):
                dist.barrier()
        if self._calls is not None:
            self._calls.close()
            self._calls = None
        if connected and self.session.installed is not None:
            unheld = self._unheld()
            self._unheld_after_fit = {rank: unheld(rank) for rank in range(self.world_size)} if unheld else {}
        if self._gather is not None:
            self._gather.close()
            self._gather = None
        self.session.end_fit()
        for callback in (self._refresh_for_evaluation, self._hold_released):
            if callback in self._trainer_callbacks:
                self._trainer_callbacks.remove(callback)
        if self._restore_between_steps is not None:
            self._restore_between_steps()
            self._restore_between_steps = None
        super().teardown()
        if self._start_method != "popen" and connected:
            # The worker process ends next; a live gloo group can abort it at exit.
            dist.destroy_process_group()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Say where in the burst schedule a failure (a collective timeout, say) happened."""
        self._failed = True
        if not hasattr(exception, "add_note"):
            return
        if lost_connection(exception):
            exception.add_note(
                f"deeppool: rank {self.global_rank} lost its connection to the other ranks: another rank "
                "stopped first, and its error says why"
            )
        if self._failed_collective:
            exception.add_note(
                f"deeppool: rank {self.global_rank} was in a collective issued from "
                f"{self._failed_collective} (self.log(..., sync_dist=True), all_gather, barrier, "
                "broadcast); every rank must issue the same ones, in the same order"
            )
        installed = self.session.installed
        note = write_note(exception, installed.released, self.global_rank) if installed is not None else None
        if note is not None:
            exception.add_note(note)
        runtime = installed.runtime if installed is not None else None
        action = runtime.running if runtime is not None else None
        if action is not None:
            exception.add_note(
                f"deeppool: rank {self.global_rank} was running action {action} of the plan's schedule"
            )

    # ------------------------------------------------------------------------------ the step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._calls is None:
            return super().training_step(*args, **kwargs)
        with self._calls.training_step():
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Backward, then synchronize the gradients it produced (unless accumulating) before the
        `on_after_backward` hooks run, as DDP's are final when its backward returns. (Lightning's
        `Strategy.backward` with the synchronisation between the backward and its hooks.)"""
        if self._calls is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        with self.session.step_times.backward():
            with self._calls.backward(last=self._sync_gradients):
                self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
            if self._sync_gradients:
                self._calls.sync_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip gradient all-reduces on accumulation steps; the last micro-batch syncs the sum."""
        self._sync_gradients = False
        try:
            yield
        finally:
            self._sync_gradients = True

    @override
    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        calls = self._calls

        def closure_then_sync() -> Any:
            with self.session.step_times.outside_work():  # training_step: its planned calls count themselves
                result = closure()
            if calls is not None:
                calls.check_installed()
                calls.sync_gradients(optimizer)
            return result

        with self.session.step_times.work():
            output = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        if calls is not None:
            calls.after_optimizer_step()
        return output

    def _between_steps(self, broadcast: Callable[[], None]) -> None:
        """Lightning's wait for rank 0 before each step (`broadcast`: rank 0's SIGTERM flag): idle time,
        and a collective every rank issues. Where the ranks meet, the flag travels with the meeting."""
        agreement = self._calls.agreement if self._calls is not None else None
        with self.idle_windows.window("between_steps"):
            if agreement is None:
                with self._collective("broadcast", hook="between steps"):
                    broadcast()
                return
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            flag = int(bool(getattr(trainer, "received_sigterm", False)))
            if agreement.before_collective("between steps (SIGTERM flag)", (flag,))[0] == (1,):
                raise SIGTERMException()

    @contextmanager
    def _collective(self, issued: str, hook: str | None = None) -> Generator[None, None, None]:
        """A collective `issued` through Lightning (the operation's name), named by the hook that
        issued it. Where the ranks meet (`CallAgreement`), they first check every rank issues this one."""
        hook = hook or getattr(self.lightning_module, "_current_fx_name", None) or "Lightning"
        hook = f"{hook} ({issued})"
        agreement = self._calls.agreement if self._calls is not None else None
        if agreement is not None:
            agreement.before_collective(hook)
        try:
            yield
        except BaseException:
            self._failed_collective = self._failed_collective or hook
            raise

    # Lightning's own collectives (`self.log(sync_dist=True)`, `self.all_gather`, ...) block too.
    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        ddp_reduce = super().reduce

        def reduce() -> Any:
            with self._collective("reduce"):
                return ddp_reduce(tensor, *args, **kwargs)

        return checked_reduction(tensor, self._unheld(), reduce, self._reducing_in)

    def _unheld(self) -> Callable[[int], list[str]] | None:
        """The parameters each rank holds as NaN (its copies of them too: an EMA of the weights), under
        this fit's plan or, after a fit, the last one's; None where every rank's are current."""
        installed = self.session.installed
        if installed is None:
            after_fit = self._unheld_after_fit
            return (lambda rank: after_fit.get(rank, [])) if after_fit else None
        if not installed.narrow or self.session.options.current_weights:
            return None
        return installed.not_held

    def _reducing_in(self) -> str | None:
        """The hook a reduction is issued from, or the loop whose epoch end reduces logged values."""
        hook = getattr(self.lightning_module, "_current_fx_name", None)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if hook is not None or trainer is None or trainer.state.stage is None:
            return hook
        return f"the end of the {trainer.state.stage.value} epoch (values logged with on_epoch=True)"

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        reduced = super().reduce_boolean_decision(decision, all)
        installed = self.session.installed
        if self._calls is not None and installed is not None and installed.narrow:
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            metrics = trainer.callback_metrics if trainer is not None else {}
            check_decision(
                decision, metrics, installed, getattr(self.lightning_module, "_current_fx_name", None)
            )
        return reduced

    @override
    def all_gather(self, *args: Any, **kwargs: Any) -> Any:
        with self._collective("all_gather"):
            return super().all_gather(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self._collective("broadcast"):
            return super().broadcast(obj, src)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with self._collective("barrier"):
            super().barrier(*args, **kwargs)

    # ------------------------------------------------------------------------ forward takeover
    def _planned_module(self) -> nn.Module:
        assert self.lightning_module is not None
        return planned_submodule(self.lightning_module, self.module_name)

    def _log_dir(self) -> str | None:
        """The run's log directory (collective: `trainer.log_dir` broadcasts)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer.log_dir if trainer is not None else None
