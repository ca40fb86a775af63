"""`BackgroundTrainers`: a foreground Trainer's callback that trains `BackgroundJob`s on its devices.

After `warmup_steps` foreground steps (the first deeppool step plans) every rank resolves the mode
(`throttle.choose_mode`) and the jobs are placed by idle share (`placement`, the one collective of
this callback). Each rank trains its jobs in threads of its own process (`pool.JobPool`). On CPU the
jobs run inside the deeppool runtime's idle windows, or, without them (one device, plain DDP), in a
window the callback opens after each foreground step whose length is the allowed slowdown. The
throttle (`pacing.Pacing`) holds them on probe steps to keep measuring the foreground alone, keeps
the slowdown within `max_slowdown` and holds them while they gain less than the foreground loses.

Reporting is per rank and never collective: metrics go through ``pl_module.log(...,
sync_dist=False)`` under ``background/<name>/...`` (Lightning's loggers write rank 0's only), and each
rank that ran jobs prints its own summary table at the end of fit.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_deeppool.background.gate import Gate
from lightning_deeppool.background.job import BackgroundJob
from lightning_deeppool.background.pacing import Pacing
from lightning_deeppool.background.placement import (
    assign_jobs,
    check_pins,
    format_placement,
    gather_idle_shares,
    idle_share,
)
from lightning_deeppool.background.pool import JobPool
from lightning_deeppool.background.report import format_summary, job_metrics
from lightning_deeppool.background.streams import ForegroundPriority
from lightning_deeppool.background.throttle import MODES, choose_mode, window_budget
from lightning_deeppool.planner.plan import Plan
from lightning_deeppool.runtime.idle import IdleWindows

# Python hands the GIL to a waiting thread only after this long: the foreground, back from a wait,
# would otherwise queue up to 5 ms (the default) behind a background thread's Python code.
_SWITCH_INTERVAL_S = 2e-4


class BackgroundTrainers(Callback):
    """Train `jobs` in the time the foreground leaves on its devices.

    Args:
        jobs: the `BackgroundJob`s, started in this order on each rank.
        mode: ``"auto"``, ``"idle"``, ``"priority"`` (CUDA) or ``"between_steps"``; see `throttle`.
        max_slowdown: the foreground's step time may grow at most by this factor.
        require_gain: hold the jobs while their progress (in device-seconds per second) is less than
            the share of its rate the foreground loses, so that background work never lowers total
            throughput. ``False`` lets them take up to `max_slowdown` whatever they gain (a time
            slice, as ``"between_steps"`` on one device is).
        slots_per_device: jobs that run at the same time on one rank.
        min_idle_fraction: unpinned jobs go only to ranks idle at least this share of the step (every
            rank, if none is): measured in the warm-up steps on CPU, the plan's share on CUDA.
        warmup_steps: foreground steps before the jobs are placed and start; the later half of them
            are the first baseline (the first step plans, the next ones settle).
        probe_every: every this many steps, one step runs with the jobs held to re-measure the baseline.
        adjust_every: steps with active jobs between duty adjustments and trade checks.
        stop_timeout_s: how long teardown waits for the job threads (they are daemons beyond that).
    """

    def __init__(
        self,
        jobs: list[BackgroundJob],
        *,
        mode: str = "auto",
        max_slowdown: float = 1.10,
        require_gain: bool = True,
        slots_per_device: int = 1,
        min_idle_fraction: float = 0.25,
        warmup_steps: int = 6,
        probe_every: int = 20,
        adjust_every: int = 5,
        stop_timeout_s: float = 30.0,
    ) -> None:
        jobs = list(jobs)
        if not jobs or not all(isinstance(job, BackgroundJob) for job in jobs):
            raise TypeError("jobs must be a non-empty list of BackgroundJob")
        if mode != "auto" and mode not in MODES:
            raise ValueError(f"unknown background mode {mode!r}; expected 'auto' or one of {MODES}")
        if not max_slowdown >= 1.0:
            raise ValueError(f"max_slowdown must be >= 1.0, got {max_slowdown}")
        if not 0.0 <= min_idle_fraction <= 1.0:
            raise ValueError(f"min_idle_fraction must be in [0, 1], got {min_idle_fraction}")
        for label, value in (
            ("slots_per_device", slots_per_device),
            ("warmup_steps", warmup_steps),
            ("probe_every", probe_every),
            ("adjust_every", adjust_every),
        ):
            if value < 1:
                raise ValueError(f"{label} must be >= 1, got {value}")
        if warmup_steps < 3:
            raise ValueError(
                f"warmup_steps must be >= 3 (the first step plans and the jobs start during the last), "
                f"got {warmup_steps}"
            )
        names: list[str] = []
        for index, job in enumerate(jobs):
            job.name = name = job.name or f"job{index}"
            names.append(name)
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"background job names must be unique; repeated: {duplicates}")
        self.jobs = jobs
        self.mode = mode
        self.max_slowdown = float(max_slowdown)
        self.require_gain = require_gain
        self.slots_per_device = slots_per_device
        self.min_idle_fraction = float(min_idle_fraction)
        self.warmup_steps = warmup_steps
        self.probe_every = probe_every
        self.adjust_every = adjust_every
        self.stop_timeout_s = stop_timeout_s
        self._reset()

    def _reset(self) -> None:
        self.resolved_mode: str | None = None
        self.idle_fractions: list[float] = []
        self.pacing = Pacing(
            max_slowdown=self.max_slowdown,
            require_gain=self.require_gain,
            settle_steps=max(1, self.warmup_steps // 2),
            probe_every=self.probe_every,
            adjust_every=self.adjust_every,
        )
        self._pool: JobPool | None = None
        self._gate: Gate | None = None
        self._windows: IdleWindows | None = None
        self._own_windows = IdleWindows()
        self._device = torch.device("cpu")
        self._priority: ForegroundPriority | None = None
        self._windows_s = 0.0
        self._warmup_idle: list[float] = []
        self._switch_interval = sys.getswitchinterval()

    def __getstate__(self) -> dict[str, Any]:
        # Spawned ranks get the configuration; threads, events and streams stay behind.
        state = self.__dict__.copy()
        for key in ("_pool", "_gate", "_windows", "_priority"):
            state[key] = None
        return state

    @property
    def local_jobs(self) -> list[BackgroundJob]:
        """The jobs placed on this rank (none before placement)."""
        return self._pool.jobs if self._pool is not None else []

    @property
    def duty(self) -> float | None:
        """The share of time background pieces may take now (None before the jobs start)."""
        return self._gate.duty if self._gate is not None else None

    # ------------------------------------------------------------------------------ lifecycle
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        root = Path(trainer.default_root_dir) / "background"
        for job in self.jobs:
            job.checkpoint_dir = job.checkpoint_dir or root
        check_pins(self.jobs, trainer.world_size)
        self._device = trainer.strategy.root_device
        windows = getattr(trainer.strategy, "idle_windows", None)
        self._windows = windows if isinstance(windows, IdleWindows) else None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        windows_s = self._windows.total_s if self._windows is not None else 0.0
        running = self._pool is not None and self._pool.running
        work_s = self._pool.work_s if self._pool is not None else 0.0
        period = self.pacing.batch_start(time.perf_counter(), running=running, work_s=work_s)
        if self.resolved_mode is None and self.pacing.steps >= 2 and period:
            # A warm-up step after the planning one: the share of it spent waiting on other ranks.
            self._warmup_idle.append((windows_s - self._windows_s) / period)
        self._windows_s = windows_s
        if self._gate is not None:
            self._gate.held = self.pacing.held

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.resolved_mode is None and self.pacing.steps + 1 >= self.warmup_steps:
            self._place(trainer)
            if self.local_jobs:
                self._start()
        if self._gate is not None and self._pool is not None:
            self._gate.duty = self.pacing.duty
            self._pool.fill(self._gate)
            pl_module.log_dict(
                job_metrics(self.local_jobs, self.duty),
                on_step=True,
                on_epoch=False,
                sync_dist=False,  # per-rank values: a reduction would make logging collective
                rank_zero_only=False,
                batch_size=1,
            )
            if self.resolved_mode == "between_steps" and self._pool.running and not self.pacing.held:
                self._between_steps_window()
        self.pacing.batch_end()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.pacing.untime()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.pacing.untime()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._shutdown(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._shutdown(trainer)

    # ---------------------------------------------------------------------------------- jobs
    def _place(self, trainer: pl.Trainer) -> None:
        """Resolve the mode and place the jobs: every rank at the same step (a collective)."""
        has_windows = self._windows is not None and self._windows.opened > 0
        cuda = self._device.type == "cuda"
        self.resolved_mode = choose_mode(self.mode, cuda=cuda, has_windows=has_windows)
        plan = getattr(trainer.strategy, "plan", None)
        share = idle_share(
            cuda=cuda,
            plan=plan if isinstance(plan, Plan) else None,
            rank=trainer.global_rank,
            warmup_idle=self._warmup_idle,
        )
        self.idle_fractions = gather_idle_shares(share, trainer.world_size)
        placed = assign_jobs(self.jobs, self.idle_fractions, self.min_idle_fraction)
        if trainer.global_rank == 0:
            print(format_placement(placed, self.idle_fractions, self.resolved_mode), flush=True)
        local = placed[trainer.global_rank]
        for job in local:
            job.stats = type(job.stats)(rank=trainer.global_rank)
        self._pool = JobPool(local, slots=self.slots_per_device, device=self._device)

    def _start(self) -> None:
        windows = self._windows if self.resolved_mode == "idle" else self._own_windows
        assert windows is not None and self.resolved_mode is not None and self._pool is not None
        if self._device.type == "cuda":
            self._priority = ForegroundPriority(self._device)
            self._priority.raise_()
        self._gate = Gate(windows, self.resolved_mode)
        self.pacing.untime()  # the jobs start part-way through this step's period
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(_SWITCH_INTERVAL_S)

    def _between_steps_window(self) -> None:
        assert self._gate is not None
        if not self.pacing.held_s:
            return
        budget = window_budget(self.pacing.baseline_s(), max_slowdown=self.max_slowdown, duty=self._gate.duty)
        with self._own_windows.window("between_steps"):
            self._gate.stop.wait(budget)

    def _shutdown(self, trainer: pl.Trainer) -> None:
        """Stop every job thread (each checkpoints on its way out) and print this rank's table."""
        if self._gate is not None and self._pool is not None:
            self._pool.stop(self._gate, self.stop_timeout_s)
            self._gate = None
            sys.setswitchinterval(self._switch_interval)
            if self.local_jobs:
                print(self.format_summary(trainer.global_rank), flush=True)
        if self._priority is not None:
            self._priority.restore()
            self._priority = None

    # ------------------------------------------------------------------------------ reporting
    def summary(self) -> list[dict[str, Any]]:
        """One row per job of this rank (see `JobPool.summary`)."""
        return self._pool.summary() if self._pool is not None else []

    def format_summary(self, rank: int) -> str:
        return format_summary(
            self.summary(),
            rank=rank,
            mode=self.resolved_mode,
            held_s=self.pacing.held_s,
            active_s=self.pacing.active_s,
            held_by_trade=self.pacing.held_by_trade,
        )
