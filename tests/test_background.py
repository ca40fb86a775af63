"""Background trainers: policy, placement, progress, checkpoints, failures, foreground identity."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_deeppool import BackgroundJob, BackgroundTrainers, DeepPoolStrategy
from lightning_deeppool.background import assign_jobs
from lightning_deeppool.background.gate import Gate
from lightning_deeppool.background.job import run_standalone
from lightning_deeppool.background.pacing import Pacing
from lightning_deeppool.background.placement import check_pins, idle_share
from lightning_deeppool.background.pool import THREAD_PREFIX
from lightning_deeppool.background.throttle import (
    FIRST_HOLD_STEPS,
    DutyControl,
    TradeCheck,
    choose_mode,
    foreground_loss,
    may_run,
    window_budget,
)
from lightning_deeppool.planner.plan import LayerPlan, Plan
from lightning_deeppool.runtime.idle import HISTORY, IdleWindows


class Trial(pl.LightningModule):
    """A small background job: SGD with momentum and a step-interval scheduler."""

    def __init__(self, lr: float = 0.1, fail_at: int | None = None, oom_at: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.calls += 1
        if self.hparams.fail_at == self.calls:
            raise ValueError("trial diverged")
        if self.hparams.oom_at == self.calls:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Foreground(pl.LightningModule):
    """Convs then a wide head: pinned to mixed widths so rank 1 waits (milliseconds, long enough for
    a job's pieces) while rank 0 runs the head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8 * 8 * 8, 4096)
        self.out = nn.Linear(4096, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.head(torch.relu(self.conv(x)).flatten(1))))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def trial_data(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g))


def trial_loader() -> DataLoader:
    return DataLoader(trial_data(), batch_size=4, shuffle=True)


def image_data(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


class Probe(Callback):
    """Placed after BackgroundTrainers: at teardown, write what this rank saw to <out>/rank<r>.json."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        background = next((c for c in trainer.callbacks if isinstance(c, BackgroundTrainers)), None)
        windows = getattr(trainer.strategy, "idle_windows", None)
        report = {
            "threads": [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)],
            "windows_opened": windows.opened if windows is not None else 0,
            "between_steps_learned": windows is not None and windows.expected_s("between_steps") < math.inf,
            "mode": background.resolved_mode if background else None,
            "idle_fractions": background.idle_fractions if background else [],
            "jobs": background.summary() if background else [],
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def foreground_trainer(steps: int, callbacks: list[Callback], root: Path, **kwargs: object) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=str(root),
        **kwargs,  # type: ignore[arg-type]
    )


def fit_single(steps: int, callbacks: list[Callback], root: Path) -> dict[str, torch.Tensor]:
    pl.seed_everything(7)
    model = Trial()
    loader = DataLoader(trial_data(), batch_size=8, shuffle=True)
    foreground_trainer(steps, callbacks, root, devices=1).fit(model, loader)
    return {k: v.clone() for k, v in model.state_dict().items()}


def fit_deeppool(
    world: int, steps: int, callbacks: list[Callback], root: Path, strategy: object
) -> Foreground:
    pl.seed_everything(3)
    model = Foreground()
    trainer = foreground_trainer(steps, callbacks, root, devices=world, strategy=strategy)
    trainer.fit(model, DataLoader(image_data(), batch_size=4))
    return model


def pinned_strategy() -> DeepPoolStrategy:
    return DeepPoolStrategy(
        start_method="spawn",
        plan={"conv": 2, "head": 1, "out": 1, "": 2},
        cache_dir=False,
        profile_warmup=1,
        profile_repeats=1,
    )


# ---------------------------------------------------------------------------------- policy
def test_may_run_follows_the_mode_and_the_hold() -> None:
    assert may_run("idle", window_fits=True, held=False)
    assert not may_run("idle", window_fits=False, held=False)
    assert not may_run("between_steps", window_fits=True, held=True)
    assert may_run("priority", window_fits=False, held=False)
    assert not may_run("priority", window_fits=True, held=True)


def test_policies_raise_on_unknown_modes() -> None:
    with pytest.raises(ValueError, match="unknown background mode 'always'"):
        may_run("always", window_fits=True, held=False)
    with pytest.raises(ValueError, match="unknown background mode 'fast'; expected 'auto' or one of"):
        choose_mode("fast", cuda=False, has_windows=True)
    with pytest.raises(ValueError, match="unknown background mode 'x'"):
        BackgroundTrainers([BackgroundJob(Trial(), trial_loader)], mode="x")


def test_choose_mode_prefers_windows_on_cpu_and_priority_on_cuda() -> None:
    assert choose_mode("auto", cuda=True, has_windows=True) == "priority"
    assert choose_mode("auto", cuda=False, has_windows=True) == "idle"
    assert choose_mode("auto", cuda=False, has_windows=False) == "between_steps"
    with pytest.raises(ValueError, match="'priority' needs CUDA streams"):
        choose_mode("priority", cuda=False, has_windows=True)
    with pytest.raises(ValueError, match="'idle' needs the idle windows of a deeppool runtime"):
        choose_mode("idle", cuda=False, has_windows=False)


def test_duty_holds_after_one_slow_window_and_halves_after_two() -> None:
    control = DutyControl(max_slowdown=1.1, duty=0.5)
    assert control.update(baseline_s=1.0, observed_s=1.2) == 0.5
    assert control.update(baseline_s=1.0, observed_s=1.2) == 0.25
    assert control.update(baseline_s=1.0, observed_s=1.2) == 0.25


def test_duty_grows_by_an_eighth_within_the_limit_and_a_good_window_clears_strikes() -> None:
    control = DutyControl(max_slowdown=1.1, duty=0.5)
    assert control.update(baseline_s=1.0, observed_s=1.2) == 0.5
    assert control.update(baseline_s=1.0, observed_s=1.05) == 0.625
    assert control.update(baseline_s=1.0, observed_s=1.2) == 0.625
    assert control.update(baseline_s=1.0, observed_s=1.0) == 0.75


def test_duty_stays_within_its_bounds() -> None:
    assert DutyControl(max_slowdown=1.1, duty=1.0).update(baseline_s=1.0, observed_s=1.0) == 1.0
    low = DutyControl(max_slowdown=1.1, duty=1 / 64, strikes=1)
    assert low.update(baseline_s=1.0, observed_s=9.0) == 1 / 64
    with pytest.raises(ValueError, match="step times must be positive"):
        low.update(baseline_s=0.0, observed_s=1.0)


def test_foreground_loss_is_the_share_of_its_rate_lost() -> None:
    assert foreground_loss(baseline_s=0.1, observed_s=0.125) == pytest.approx(0.2)
    assert foreground_loss(baseline_s=0.1, observed_s=0.1) == 0.0


def test_trade_holds_the_jobs_after_two_windows_that_gain_less_than_the_foreground_loses() -> None:
    trade = TradeCheck()
    trade.record(gain=0.02, loss=0.08)
    assert not trade.tick()
    trade.record(gain=0.02, loss=0.08)
    assert [trade.tick() for _ in range(FIRST_HOLD_STEPS + 1)] == [True] * FIRST_HOLD_STEPS + [False]


def test_trade_doubles_each_hold_until_a_window_pays() -> None:
    trade = TradeCheck()
    for _ in range(4):
        trade.record(gain=0.0, loss=0.05)
    assert (trade.holds, trade.held_left, trade.hold_steps) == (2, 2 * FIRST_HOLD_STEPS, 4 * FIRST_HOLD_STEPS)
    trade.record(gain=0.4, loss=0.01)
    assert (trade.losing, trade.hold_steps) == (0, FIRST_HOLD_STEPS)


def test_a_losing_window_between_paying_ones_does_not_hold() -> None:
    trade = TradeCheck()
    for gain in (0.0, 0.3, 0.0, 0.3):
        trade.record(gain=gain, loss=0.05)
    assert (trade.holds, trade.tick()) == (0, False)


def run_pacing(pacing: Pacing, steps: int, *, step_s: float, work_per_step_s: float) -> list[bool]:
    """Drive `pacing` through `steps` made-up steps (1 s baseline steps): `step_s` long while the
    jobs run, and the jobs progress `work_per_step_s` device-seconds per running step. Returns
    whether the jobs were held, step by step."""
    now, work, held = 0.0, 0.0, []
    for _ in range(steps):
        pacing.batch_start(now, running=True, work_s=work)
        held.append(pacing.held)
        now += 1.0 if pacing.held else step_s
        work += 0.0 if pacing.held else work_per_step_s
        pacing.batch_end()
    return held


def pacing(require_gain: bool = True) -> Pacing:
    return Pacing(max_slowdown=1.1, require_gain=require_gain, settle_steps=1, probe_every=20, adjust_every=5)


def test_pacing_holds_jobs_that_slow_the_foreground_more_than_they_gain() -> None:
    losing = pacing()
    held = run_pacing(losing, 120, step_s=1.08, work_per_step_s=0.03)  # loses 7%, gains 3%
    assert losing.trade is not None and losing.trade.holds >= 1
    assert sum(held[60:]) > 40  # mostly held once the trade check has seen two windows
    assert losing.duty == 1.0  # within max_slowdown: the duty alone would have let them run


def test_pacing_lets_jobs_run_that_gain_more_than_the_foreground_loses() -> None:
    paying = pacing()
    held = run_pacing(paying, 120, step_s=1.02, work_per_step_s=0.4)
    assert paying.trade is not None and paying.trade.holds == 0
    assert sum(held[60:]) <= 4  # only the probe steps
    assert paying.held_by_trade == 0


def test_pacing_without_require_gain_lets_jobs_take_up_to_the_slowdown_limit() -> None:
    slicing = pacing(require_gain=False)
    held = run_pacing(slicing, 120, step_s=1.08, work_per_step_s=0.03)
    assert slicing.trade is None and sum(held[60:]) <= 4


def test_pacing_halves_the_duty_when_the_foreground_slows_beyond_the_limit() -> None:
    slow = pacing(require_gain=False)
    run_pacing(slow, 60, step_s=1.3, work_per_step_s=0.5)
    assert slow.duty < 0.5
    assert 1.3 in slow.active_s and slow.baseline_s() == 1.0


def test_cpu_ranks_place_by_measured_idle_share_and_cuda_ranks_by_the_plan() -> None:
    layers = tuple(
        LayerPlan(name=name, module=name, width=width, compute_s=s, sync_s=0.0, transfer_s=0.0, params=0)
        for name, width, s in (("conv", 2, 0.03), ("head", 1, 0.01))
    )
    plan = Plan(2, 8, 2.0, 0.04, 0.04, "graph", layers)
    assert idle_share(cuda=False, plan=plan, rank=1, warmup_idle=[0.1, 0.5, 0.2]) == 0.2
    assert idle_share(cuda=True, plan=plan, rank=1, warmup_idle=[0.9]) == pytest.approx(0.25)
    assert idle_share(cuda=True, plan=plan, rank=0, warmup_idle=[0.9]) == 0.0
    assert idle_share(cuda=True, plan=None, rank=1, warmup_idle=[0.9]) == 0.0
    assert idle_share(cuda=False, plan=None, rank=1, warmup_idle=[]) == 0.0


def test_between_steps_window_is_the_slowdown_allowance_scaled_by_duty() -> None:
    assert window_budget(0.1, max_slowdown=1.1, duty=0.5) == pytest.approx(0.005)


def test_jobs_round_robin_from_the_highest_rank_unless_pinned() -> None:
    jobs = [BackgroundJob(Trial(), trial_loader, name=f"j{i}") for i in range(4)]
    jobs.append(BackgroundJob(Trial(), trial_loader, name="pinned", rank=0))
    placed = assign_jobs(jobs, [0.5, 0.5, 0.5], min_idle_fraction=0.1)
    assert {rank: [j.name for j in js] for rank, js in placed.items()} == {
        2: ["j0", "j3"],
        1: ["j1"],
        0: ["j2", "pinned"],
    }


def test_unpinned_jobs_skip_ranks_with_too_little_idle_time() -> None:
    jobs = [BackgroundJob(Trial(), trial_loader, name=f"j{i}") for i in range(3)]
    jobs.append(BackgroundJob(Trial(), trial_loader, name="pinned", rank=0))
    placed = assign_jobs(jobs, [0.02, 0.4, 0.05], min_idle_fraction=0.1)
    assert {rank: [j.name for j in js] for rank, js in placed.items()} == {
        2: [],
        1: ["j0", "j1", "j2"],
        0: ["pinned"],
    }


def test_jobs_use_every_rank_when_none_has_enough_idle_time() -> None:
    jobs = [BackgroundJob(Trial(), trial_loader, name=f"j{i}") for i in range(2)]
    placed = assign_jobs(jobs, [0.0, 0.01], min_idle_fraction=0.1)
    assert {rank: [j.name for j in js] for rank, js in placed.items()} == {1: ["j0"], 0: ["j1"]}


def test_a_job_pinned_beyond_the_world_is_an_error() -> None:
    with pytest.raises(ValueError, match="pinned to rank 5, but the foreground has 3 ranks"):
        check_pins([BackgroundJob(Trial(), trial_loader, name="far", rank=5)], 3)


def test_job_names_must_be_unique() -> None:
    jobs = [BackgroundJob(Trial(), trial_loader, name="same") for _ in range(2)]
    with pytest.raises(ValueError, match=r"repeated: \['same'\]"):
        BackgroundTrainers(jobs)


# ------------------------------------------------------------------------- single device
def test_jobs_progress_queue_and_checkpoint_on_one_device(tmp_path: Path) -> None:
    jobs = [
        BackgroundJob(lambda: Trial(lr=0.05), trial_loader, max_steps=4, name="a", checkpoint_every=2),
        BackgroundJob(Trial(lr=0.2), trial_loader, max_steps=3, name="b"),
    ]
    callback = BackgroundTrainers(jobs, max_slowdown=5.0, require_gain=False, warmup_steps=3)
    fit_single(40, [callback], tmp_path)
    assert callback.resolved_mode == "between_steps"
    assert [(r["name"], r["state"], r["global_step"]) for r in callback.summary()] == [
        ("a", "done", 4),
        ("b", "done", 3),
    ]
    assert [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)] == []
    loaded = Trial.load_from_checkpoint(tmp_path / "background" / "a.ckpt")
    assert loaded.hparams.lr == 0.05
    checkpoint = torch.load(tmp_path / "background" / "a.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 4
    assert checkpoint["lr_schedulers"][0]["last_epoch"] == 4
    assert len(checkpoint["optimizer_states"][0]["state"]) == 4


def test_a_resumed_job_continues_exactly_where_it_stopped(tmp_path: Path) -> None:
    def job(steps: int, folder: str) -> BackgroundJob:
        return BackgroundJob(
            lambda: Trial(), trial_loader, max_steps=steps, name="t", checkpoint_dir=tmp_path / folder
        )

    cpu = torch.device("cpu")
    assert run_standalone(job(8, "resumed"), cpu).global_step == 8  # stage 1 then extended below
    first = job(17, "resumed")
    straight = job(17, "straight")
    assert run_standalone(first, cpu).global_step == 17
    assert run_standalone(straight, cpu).global_step == 17
    a = torch.load(tmp_path / "resumed" / "t.ckpt", weights_only=False)
    b = torch.load(tmp_path / "straight" / "t.ckpt", weights_only=False)
    assert first.stats.session_steps == 9
    assert (a["epoch"], a["lr_schedulers"]) == (b["epoch"], b["lr_schedulers"])
    for key, value in b["state_dict"].items():
        assert torch.equal(a["state_dict"][key], value), key


def test_failing_and_oom_jobs_are_reported_and_leave_the_foreground_untouched(tmp_path: Path) -> None:
    reference = fit_single(12, [], tmp_path / "ref")
    jobs = [
        BackgroundJob(lambda: Trial(fail_at=2), trial_loader, name="diverges"),
        BackgroundJob(lambda: Trial(oom_at=1), trial_loader, name="oom"),
        BackgroundJob(lambda: Trial(), trial_loader, max_steps=2, name="fine"),
    ]
    callback = BackgroundTrainers(
        jobs, max_slowdown=5.0, require_gain=False, warmup_steps=3, slots_per_device=2
    )
    weights = fit_single(12, [callback], tmp_path / "bg")
    rows = {r["name"]: r for r in callback.summary()}
    assert (rows["diverges"]["state"], rows["diverges"]["global_step"]) == ("failed", 1)
    assert "ValueError: trial diverged" in rows["diverges"]["error"]
    assert rows["oom"]["state"] == "failed"
    assert "OutOfMemoryError: CUDA out of memory" in rows["oom"]["error"]
    assert (rows["fine"]["state"], rows["fine"]["global_step"]) == ("done", 2)
    for key, value in reference.items():
        assert torch.equal(weights[key], value), key


class SchedulerPolicy(Trial):
    """Records the OS scheduling policy of the thread that runs its training step."""

    policies: list[int] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        SchedulerPolicy.policies.append(os.sched_getscheduler(0))
        return super().training_step(batch, batch_idx)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux only")
def test_job_threads_run_in_the_idle_scheduling_class_and_the_foreground_does_not(tmp_path: Path) -> None:
    SchedulerPolicy.policies = []
    jobs = [BackgroundJob(SchedulerPolicy, trial_loader, max_steps=2, name="policy")]
    fit_single(8, [BackgroundTrainers(jobs, max_slowdown=5.0, require_gain=False, warmup_steps=3)], tmp_path)
    assert SchedulerPolicy.policies == [os.SCHED_IDLE, os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


class Busy(nn.Module):
    """A submodule whose forward burns 20 ms of CPU: one long piece among short ones."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
        return x


class LongPiece(Trial):
    def __init__(self) -> None:
        super().__init__()
        self.busy = Busy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.busy(torch.relu(self.a(x))))


def test_a_job_counts_each_piece_as_its_shortest_recent_duration(tmp_path: Path) -> None:
    run = BackgroundJob(Trial(), trial_loader, name="t", checkpoint_dir=tmp_path).build(torch.device("cpu"))
    now = [0.0]
    run._clock = lambda: now[0]  # made-up piece durations instead of the thread's CPU time
    gate = Gate(IdleWindows(), "priority")
    run._enter(gate, step_start=True)
    for piece_s, step_start in ((1.0, False), (2.0, True), (3.0, False), (2.0, True), (1.5, False)):
        now[0] += piece_s
        run._enter(gate, step_start=step_start)
    # place 0 took 1, 3 (slowed: counts 1), 1.5 (counts 1); place 1 took 2 and 2.
    assert run.job.stats.work_s == pytest.approx(1 + 2 + 1 + 2 + 1)


def test_a_piece_that_does_not_fit_the_windows_left_waits_at_its_safe_point(tmp_path: Path) -> None:
    windows = IdleWindows()
    gate = Gate(windows, "idle")
    job = BackgroundJob(LongPiece, trial_loader, name="long", checkpoint_dir=tmp_path)
    thread = threading.Thread(target=job.build(torch.device("cpu")).train, args=(gate,), daemon=True)

    def open_windows(count: int, length_s: float) -> int:
        for _ in range(count):
            with windows.window("recv"):
                time.sleep(length_s)
            time.sleep(0.01)
        return job.stats.global_step

    thread.start()
    try:
        learned = open_windows(3, 0.2)  # every piece runs and is timed
        open_windows(HISTORY, 0.005)  # from now on the windows are expected to last 5 ms
        stalled = job.stats.global_step
        assert open_windows(10, 0.005) == stalled
        assert job.stats.state == "paused"
        assert open_windows(HISTORY, 0.2) > stalled  # long windows let the 20 ms piece run again
    finally:
        gate.stop.set()
        thread.join(timeout=10)
    assert learned >= 3 and job.stats.state == "stopped"


class StopsDuringBackward(Trial):
    """Sets its gate's stop from a hook in the middle of its backward (after `b`, before `a`)."""

    def __init__(self) -> None:
        super().__init__()
        self.stop: threading.Event | None = None
        self.a_grads = 0
        for p in self.a.parameters():
            p.register_post_accumulate_grad_hook(self._count)

    def _count(self, p: torch.Tensor) -> None:
        self.a_grads += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.a(x))
        stop = self.stop
        assert stop is not None
        hidden.register_hook(lambda grad: stop.set())
        return self.b(hidden)


def test_a_job_stopped_during_its_backward_finishes_that_backward_then_stops(tmp_path: Path) -> None:
    # An aborted backward would leave its nodes queued in the thread's autograd state until the
    # OS thread exits, which can abort a process that is shutting down.
    module = StopsDuringBackward()
    gate = Gate(IdleWindows(), "priority")
    module.stop = gate.stop
    job = BackgroundJob(module, trial_loader, name="mid", checkpoint_dir=tmp_path)
    thread = threading.Thread(target=job.build(torch.device("cpu")).train, args=(gate,))
    thread.start()
    thread.join(timeout=10)
    assert module.a_grads == 2  # weight and bias: the backward reached the first layer
    assert job.stats.state == "stopped" and job.stats.global_step == 0


# ----------------------------------------------------------------------------- deeppool
def test_foreground_is_bit_identical_with_background_on_two_ranks(tmp_path: Path) -> None:
    reference = fit_deeppool(2, 10, [], tmp_path / "ref", pinned_strategy()).state_dict()
    jobs = [BackgroundJob(Trial, trial_loader, name=f"t{i}", checkpoint_every=1) for i in range(2)]
    callbacks = [BackgroundTrainers(jobs, warmup_steps=3, min_idle_fraction=0.0), Probe(tmp_path)]
    model = fit_deeppool(2, 10, callbacks, tmp_path / "bg", pinned_strategy())
    for key, value in reference.items():
        assert torch.equal(model.state_dict()[key], value), key
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["threads"] for r in ranks] == [[], []]
    assert [r["mode"] for r in ranks] == ["idle", "idle"]
    assert [r["between_steps_learned"] for r in ranks] == [True, True]
    assert [[job["name"] for job in r["jobs"]] for r in ranks] == [["t1"], ["t0"]]
    assert ranks[1]["jobs"][0]["state"] == "stopped"
    steps = torch.load(tmp_path / "bg" / "background" / "t0.ckpt", weights_only=False)["global_step"]
    assert steps == ranks[1]["jobs"][0]["global_step"] >= 1


def test_three_ranks_with_the_registered_spawn_strategy_stop_every_thread(tmp_path: Path) -> None:
    jobs = [BackgroundJob(Trial, trial_loader, name=f"t{i}") for i in range(4)]
    callbacks = [BackgroundTrainers(jobs, warmup_steps=3, min_idle_fraction=0.0), Probe(tmp_path)]
    fit_deeppool(3, 6, callbacks, tmp_path, "deeppool_spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["threads"] for r in ranks] == [[], [], []]
    assert [[job["name"] for job in r["jobs"]] for r in ranks] == [["t2"], ["t1"], ["t0", "t3"]]
    assert all(r["windows_opened"] > 0 for r in ranks)
    fractions = ranks[0]["idle_fractions"]
    assert len(fractions) == 3 and all(0.0 < f < 1.0 for f in fractions)
    assert all(r["idle_fractions"] == fractions for r in ranks)
    assert {job["name"]: job["state"] for r in ranks for job in r["jobs"]} == {
        "t0": "stopped",
        "t1": "stopped",
        "t2": "stopped",
        "t3": "queued",
    }
    assert sorted(p.name for p in (tmp_path / "background").glob("*.ckpt")) == [
        "t0.ckpt",
        "t1.ckpt",
        "t2.ckpt",
    ]


# ---------------------------------------------------------------------------------- CUDA
class StreamRecorder(Trial):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.priorities = getattr(self, "priorities", set())
        self.priorities.add(torch.cuda.current_stream().priority)
        return super().training_step(batch, batch_idx)


@pytest.mark.gpu
def test_cuda_foreground_runs_high_priority_and_jobs_low_priority(tmp_path: Path) -> None:
    least, greatest = torch.cuda.Stream.priority_range()
    job_module = StreamRecorder()
    callback = BackgroundTrainers([BackgroundJob(job_module, trial_loader, max_steps=3)], warmup_steps=3)
    pl.seed_everything(0)
    foreground = StreamRecorder()
    pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=30,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[callback],
        default_root_dir=str(tmp_path),
    ).fit(foreground, DataLoader(trial_data(), batch_size=8))
    assert callback.resolved_mode == "priority"
    assert callback.summary()[0]["state"] == "done"
    assert job_module.priorities == {least}
    assert greatest in foreground.priorities
    assert torch.cuda.current_stream().priority == least  # restored to the default stream
