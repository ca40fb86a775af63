"""`BackgroundTrainers`: a foreground Trainer's callback that trains `BackgroundJob`s on its devices.

After `warmup_steps` foreground steps (the first deeppool step plans) every rank resolves the mode
(`throttle.choose_mode`) and the jobs are placed, the one collective of this callback: round-robin
from the highest rank down over the ranks with idle time (`assign_jobs`). Each rank trains its jobs,
each in a thread of the rank's own process, at most `slots_per_device` at a time; a job that ends
frees its slot for the next queued one. On CPU the jobs run inside the deeppool runtime's idle
windows, or, without them (one device, plain DDP), in a window the callback opens after each
foreground step whose length is the allowed slowdown.

The foreground's step time is the time between consecutive batch starts (all a step costs, the
wait before the next one included). Every `probe_every` steps one step runs with the jobs held, to
keep measuring it without background; the duty adapts to keep the slowdown within `max_slowdown`.

Reporting is per rank and never collective: metrics go through ``pl_module.log(...,
sync_dist=False)`` under ``background/<name>/...`` (Lightning's loggers write rank 0's only), and each
rank that ran jobs prints its own summary table at the end of fit.
"""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_deeppool.background.gate import Gate
from lightning_deeppool.background.job import (
    STATES,
    BackgroundJob,
    JobRun,
    lower_cpu_priority,
    priority_range,
)
from lightning_deeppool.background.throttle import MODES, DutyControl, choose_mode, window_budget
from lightning_deeppool.strategy.idle import IdleWindows

log = logging.getLogger(__name__)
THREAD_PREFIX = "deeppool-bg-"
_BASELINE_WINDOW = 8
_MIN_BASELINE = 5
_EARLY_PROBE_EVERY = 3
# Python hands the GIL to a waiting thread only after this long: the foreground, back from a wait,
# would otherwise queue up to 5 ms (the default) behind a background thread's Python code.
_SWITCH_INTERVAL_S = 2e-4


def assign_jobs(
    jobs: list[BackgroundJob], idle_fractions: Sequence[float], min_idle_fraction: float
) -> dict[int, list[BackgroundJob]]:
    """Pinned jobs go to their rank; the others round-robin from the highest rank down (in a burst
    plan the high ranks run the fewest layers) over the ranks whose idle fraction is at least
    `min_idle_fraction`, or over every rank when none is."""
    world_size = len(idle_fractions)
    placed: dict[int, list[BackgroundJob]] = {rank: [] for rank in range(world_size)}
    descending = list(range(world_size - 1, -1, -1))
    order = [rank for rank in descending if idle_fractions[rank] >= min_idle_fraction] or descending
    check_pins(jobs, world_size)
    unpinned = 0
    for job in jobs:
        if job.rank is not None:
            placed[job.rank].append(job)
        else:
            placed[order[unpinned % len(order)]].append(job)
            unpinned += 1
    return placed


def format_placement(
    placed: dict[int, list[BackgroundJob]], idle_fractions: Sequence[float], mode: str
) -> str:
    """One line per rank: its idle fraction and the jobs placed on it."""
    lines = [f"background jobs placed (mode {mode}):"]
    for rank in sorted(placed):
        names = ", ".join(str(job.name) for job in placed[rank]) or "-"
        lines.append(f"  rank {rank} (idle {idle_fractions[rank]:.0%}): {names}")
    return "\n".join(lines)


def check_pins(jobs: list[BackgroundJob], world_size: int) -> None:
    for job in jobs:
        if job.rank is not None and job.rank >= world_size:
            raise ValueError(
                f"background job {job.name!r} is pinned to rank {job.rank}, but the foreground has "
                f"{world_size} ranks (0..{world_size - 1})"
            )


class BackgroundTrainers(Callback):
    """Train `jobs` in the time the foreground leaves on its devices.

    Args:
        jobs: the `BackgroundJob`s, started in this order on each rank.
        mode: ``"auto"``, ``"idle"``, ``"priority"`` (CUDA) or ``"between_steps"``; see `throttle`.
        max_slowdown: the foreground's step time may grow at most by this factor.
        slots_per_device: jobs that run at the same time on one rank.
        min_idle_fraction: in ``"idle"`` mode, unpinned jobs go only to ranks whose idle windows
            covered at least this share of the warm-up steps (every rank, if none did).
        warmup_steps: foreground steps before the jobs are placed and start; the later half of them
            are the first baseline (the first step plans, the next ones settle).
        probe_every: every this many steps, one step runs with the jobs held to re-measure the baseline.
        adjust_every: steps with active jobs between duty adjustments.
        stop_timeout_s: how long teardown waits for the job threads (they are daemons beyond that).
    """

    def __init__(
        self,
        jobs: list[BackgroundJob],
        *,
        mode: str = "auto",
        max_slowdown: float = 1.10,
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
        self.slots_per_device = slots_per_device
        self.min_idle_fraction = float(min_idle_fraction)
        self.warmup_steps = warmup_steps
        self.probe_every = probe_every
        self.adjust_every = adjust_every
        self.stop_timeout_s = stop_timeout_s
        self._reset()

    def _reset(self) -> None:
        self.local_jobs: list[BackgroundJob] = []
        self.resolved_mode: str | None = None
        self.idle_step_s: list[float] = []
        self.active_step_s: list[float] = []
        self._queue: list[BackgroundJob] = []
        self._running: list[tuple[threading.Thread, BackgroundJob]] = []
        self._gate: Gate | None = None
        self._windows: IdleWindows | None = None
        self._own_windows = IdleWindows()
        self._device = torch.device("cpu")
        self._steps = 0
        self._period_start: float | None = None
        self._period_windows_s = 0.0
        self._warmup_idle: list[float] = []
        self.idle_fractions: list[float] = []
        self._period_timed = False
        self._period_active = False
        self._probing = False
        self._since_adjust = 0
        self._control = DutyControl(self.max_slowdown)
        self._streams: tuple[Any, Any] | None = None
        self._switch_interval = sys.getswitchinterval()

    def __getstate__(self) -> dict[str, Any]:
        # Spawned ranks get the configuration; threads, events and streams stay behind.
        state = self.__dict__.copy()
        for key in ("_running", "_gate", "_windows", "_streams"):
            state[key] = [] if key == "_running" else None
        return state

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
        now = time.perf_counter()
        windows_s = self._windows.total_s if self._windows is not None else 0.0
        period_s = now - self._period_start if self._period_start is not None else 0.0
        if self.resolved_mode is None and self._steps >= 2 and period_s > 0:
            # A warm-up step after the planning one: the share of it spent waiting on other ranks.
            self._warmup_idle.append((windows_s - self._period_windows_s) / period_s)
        if self._period_timed:
            if self._period_active:
                self.active_step_s.append(period_s)
                self._adjust()
            else:
                self.idle_step_s.append(period_s)
        self._period_start = now
        self._period_windows_s = windows_s
        # The first step plans; the next few run slower while caches and the allocator settle.
        self._period_timed = self._steps >= max(1, self.warmup_steps // 2)
        self._period_active = self._gate is not None and not self._probing and bool(self._running)
        if self._gate is not None:
            self._gate.held = self._probing

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._steps += 1
        if self.resolved_mode is None and self._steps >= self.warmup_steps:
            self._place(trainer)
            if self.local_jobs:
                self._start()
        if self._gate is None:
            return
        self._reap()
        self._fill_slots()
        self._log(pl_module)
        if self.resolved_mode == "between_steps" and self._running and not self._probing:
            self._between_steps_window()
        # Until the baseline has a few samples, probe more often than `probe_every`.
        every = self.probe_every if len(self.idle_step_s) >= _MIN_BASELINE else _EARLY_PROBE_EVERY
        self._probing = self._steps % every == 0

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._period_timed = False

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._period_timed = False

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
        self.resolved_mode = choose_mode(self.mode, cuda=self._device.type == "cuda", has_windows=has_windows)
        usable = 1.0
        if self.resolved_mode == "idle" and self._warmup_idle:
            usable = statistics.median(self._warmup_idle)  # one step a peer was late must not count
        self.idle_fractions = [usable]
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            self.idle_fractions = [0.0] * trainer.world_size
            dist.all_gather_object(self.idle_fractions, usable)
        placed = assign_jobs(self.jobs, self.idle_fractions, self.min_idle_fraction)
        if trainer.global_rank == 0:
            print(format_placement(placed, self.idle_fractions, self.resolved_mode), flush=True)
        self.local_jobs = placed[trainer.global_rank]
        for job in self.local_jobs:
            job.stats = type(job.stats)(rank=trainer.global_rank)
        self._queue = list(self.local_jobs)

    def _start(self) -> None:
        windows = self._windows if self.resolved_mode == "idle" else self._own_windows
        assert windows is not None and self.resolved_mode is not None
        if self._device.type == "cuda":
            self._raise_foreground_priority()
        self._gate = Gate(windows, self.resolved_mode)
        self._period_timed = False  # the jobs start part-way through this step's period
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(_SWITCH_INTERVAL_S)
        self._fill_slots()

    def _fill_slots(self) -> None:
        assert self._gate is not None
        while self._queue and len(self._running) < self.slots_per_device:
            job = self._queue.pop(0)
            try:
                run = job.build(self._device)
            except Exception:
                self._failed(job, traceback.format_exc())
                continue
            thread = threading.Thread(
                target=_train_in_background,
                args=(run, self._gate),
                name=f"{THREAD_PREFIX}{job.name}",
                daemon=True,
            )
            job.stats.state = "running"
            thread.start()
            self._running.append((thread, job))

    def _reap(self) -> None:
        still = []
        for thread, job in self._running:
            if thread.is_alive():
                still.append((thread, job))
            elif job.stats.state == "failed":
                self._failed(job, job.stats.error or "")
        self._running = still

    def _failed(self, job: BackgroundJob, text: str) -> None:
        job.stats.state = "failed"
        job.stats.error = text
        log.error(
            "background job %r failed on rank %s; the foreground goes on:\n%s", job.name, job.stats.rank, text
        )

    def _adjust(self) -> None:
        assert self._gate is not None
        self._since_adjust += 1
        if self._since_adjust < self.adjust_every or not self.idle_step_s:
            return
        self._since_adjust = 0
        self._gate.duty = self._control.update(
            baseline_s=self.baseline_step_s(),
            observed_s=statistics.median(self.active_step_s[-self.adjust_every :]),
        )

    def _between_steps_window(self) -> None:
        assert self._gate is not None
        if not self.idle_step_s:
            return
        baseline = self.baseline_step_s()
        budget = window_budget(baseline, max_slowdown=self.max_slowdown, duty=self._gate.duty)
        with self._own_windows.window("between_steps"):
            self._gate.stop.wait(budget)

    def _shutdown(self, trainer: pl.Trainer) -> None:
        """Stop every job thread (each checkpoints on its way out) within `stop_timeout_s`."""
        if self._gate is not None:
            self._gate.stop.set()
            deadline = time.monotonic() + self.stop_timeout_s
            for thread, job in self._running:
                thread.join(max(0.0, deadline - time.monotonic()))
                if not thread.is_alive():
                    _wait_for_os_thread(thread, min(deadline, time.monotonic() + 1.0))
                if thread.is_alive():
                    log.warning(
                        "background job %r did not stop within %.0f s; it is left as a daemon thread and "
                        "its last checkpoint is at %s",
                        job.name,
                        self.stop_timeout_s,
                        job.checkpoint_path,
                    )
            self._reap()
            self._gate = None
            sys.setswitchinterval(self._switch_interval)
            if self.local_jobs:
                print(self.format_summary(trainer.global_rank), flush=True)
        self._running = []
        self._lower_foreground_priority()

    # ------------------------------------------------------------------------------ reporting
    @property
    def duty(self) -> float | None:
        """The share of time background pieces may take now (None before the jobs start)."""
        return self._gate.duty if self._gate is not None else None

    def baseline_step_s(self) -> float:
        """Median foreground step time over recent steps without active background."""
        return statistics.median(self.idle_step_s[-_BASELINE_WINDOW:])

    def summary(self) -> list[dict[str, Any]]:
        """One row per job of this rank: name, state, steps, samples (and per second over its
        running time, from `started_s` to `ended_s` on `time.perf_counter`), last loss, error."""
        return [
            {
                "name": job.name,
                "rank": job.stats.rank,
                "state": job.stats.state,
                "global_step": job.stats.global_step,
                "samples": job.stats.samples,
                "samples_per_s": job.stats.samples_per_s,
                "started_s": job.stats.started_s,
                "ended_s": job.stats.ended_s,
                "loss": job.stats.loss,
                "error": job.stats.error,
            }
            for job in self.local_jobs
        ]

    def format_summary(self, rank: int) -> str:
        median = lambda xs: f"{statistics.median(xs) * 1e3:.1f} ms" if xs else "-"  # noqa: E731
        lines = [
            f"background jobs on rank {rank} (mode {self.resolved_mode}):",
            f"{'job':<20} {'state':<8} {'steps':>7} {'samples/s':>10} {'loss':>10}",
        ]
        for row in self.summary():
            loss = f"{row['loss']:.4f}" if row["loss"] is not None else "-"
            lines.append(
                f"{row['name']:<20} {row['state']:<8} {row['global_step']:>7} "
                f"{row['samples_per_s']:>10.1f} {loss:>10}"
            )
        lines.append(
            f"foreground step: {median(self.idle_step_s)} without background, "
            f"{median(self.active_step_s)} with ({len(self.idle_step_s)} / {len(self.active_step_s)} steps)"
        )
        for row in self.summary():
            if row["error"]:
                lines.append(f"{row['name']} failed:\n{row['error']}")
        return "\n".join(lines)

    def _log(self, pl_module: pl.LightningModule) -> None:
        # Per-rank values, never reduced: sync_dist would make logging collective.
        metrics: dict[str, float] = {}
        for job in self.local_jobs:
            prefix = f"background/{job.name}"
            metrics[f"{prefix}/steps"] = float(job.stats.global_step)
            metrics[f"{prefix}/samples_per_s"] = job.stats.samples_per_s
            metrics[f"{prefix}/state"] = float(STATES.index(job.stats.state))
            if job.stats.loss is not None:
                metrics[f"{prefix}/loss"] = job.stats.loss
        if self._gate is not None:
            metrics["background/duty"] = self._gate.duty
        pl_module.log_dict(
            metrics, on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=False, batch_size=1
        )

    # ---------------------------------------------------------------------------------- CUDA
    def _raise_foreground_priority(self) -> None:
        """Run the foreground (this, the main thread) on a new highest-priority stream."""
        _, greatest = priority_range()
        previous = torch.cuda.current_stream(self._device)
        stream = torch.cuda.Stream(self._device, priority=greatest)
        stream.wait_stream(previous)
        torch.cuda.set_stream(stream)
        self._streams = (previous, stream)

    def _lower_foreground_priority(self) -> None:
        if self._streams is None:
            return
        previous, stream = self._streams
        previous.wait_stream(stream)
        torch.cuda.set_stream(previous)
        self._streams = None


def _wait_for_os_thread(thread: threading.Thread, deadline: float) -> None:
    """Wait until the OS thread behind a joined Python thread is gone (Linux; elsewhere a no-op).

    `join` returns once the thread's Python state is released, before its C++ thread-local objects
    (torch's among them) are destroyed; a process that exits during that cleanup can abort
    ("terminate called without an active exception"), as spawned workers do right after fit.
    """
    task = Path(f"/proc/self/task/{thread.native_id}")
    while task.exists() and time.monotonic() < deadline:
        time.sleep(0.001)


def _train_in_background(run: JobRun, gate: Gate) -> None:
    """A job thread's body. On CPU the thread first lowers its OS priority, so a foreground thread
    that wakes up (its wait ended) gets a core at once instead of sharing it with the job."""
    if run.device.type == "cpu":
        lower_cpu_priority()
    run.train(gate)
