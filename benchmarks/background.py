"""Background trainers: foreground step time without and with two background jobs, and throughput.

    python benchmarks/background.py [--steps 100] [--runs 7] [--plans long,short] [--devices N] [--batch 16]

The VGG-like foreground of `vs_ddp.py` (cheap convolutions, 12.6M-parameter linear head, `--batch`
samples per device) under pinned plans, so every run and every machine gets the same one:
``long`` runs the convolutions on every rank and the head on rank 0 (the other ranks wait most of
each step), ``short`` runs every layer at full width (the waits are short), ``auto`` is the automatic
plan. On one device (`--devices 1`, the default where there is a single GPU) there is no plan: the
foreground is Lightning's single-device strategy. Each plan runs alone and with two background jobs
placed by the callback (one slot per device, so a second job on a rank waits for the first),
alternately, `--runs` times; medians are reported. Each job is also trained alone in this process.
Total throughput = the foreground's rate over its rate alone + each rank's background work in
devices (the jobs' samples over their standalone rates, over the time the rank had jobs). CPU: gloo
ranks, idle-window mode; CUDA: priority mode. Every process runs with the same fixed malloc
thresholds (see `vs_ddp.FIXED_MALLOC`). Writes `--out` (default benchmarks/results/background.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_deeppool import BackgroundJob, BackgroundTrainers, DeepPoolStrategy
from lightning_deeppool.background.job import run_standalone

from vs_ddp import FIXED_MALLOC, StepTimer, VGGLike, quiet_trainer

RESULTS = Path(__file__).parent / "results" / "background.json"
PLANS = {"long": {"features": "all", "head": 1}, "short": {"": "all"}, "auto": None}


class Trial(pl.LightningModule):
    """The background job: a small convolutional classifier (short pieces per submodule)."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(4),
            nn.Flatten(),
            nn.Linear(16 * 8 * 8, 10),
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def images(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


def trial_data() -> DataLoader:
    return DataLoader(images(512, seed=1), batch_size=16, shuffle=True)


class StepTimes(StepTimer):
    """Rank 0 writes its foreground step times (and the background report) to `out`."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.duties: list[float | None] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        background = next((c for c in trainer.callbacks if isinstance(c, BackgroundTrainers)), None)
        self.duties.append(background.duty if background else None)

    def teardown(self, trainer, pl_module, stage) -> None:  # type: ignore[no-untyped-def]
        background = next((c for c in trainer.callbacks if isinstance(c, BackgroundTrainers)), None)
        report = {
            "times": self.times,
            "jobs": background.summary() if background else [],
            "held_s": background.pacing.held_s if background else [],
            "active_s": background.pacing.active_s if background else [],
            "held_by_trade": background.pacing.held_by_trade if background else 0,
            "duty": self.duties,
            "idle_fractions": background.idle_fractions if background else [],
            "end_s": time.perf_counter(),
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def strategy_for(plan: str, devices: int, cache: Path) -> DeepPoolStrategy | str:
    """The pinned plan `plan` on `devices` ranks ("all" widths become the device count)."""
    if devices == 1:
        return "auto"
    pins = PLANS[plan]
    widths = {k: devices if v == "all" else v for k, v in pins.items()} if pins is not None else None
    return DeepPoolStrategy(start_method="spawn", cache_dir=cache, plan=widths)


def foreground(
    steps: int,
    jobs: list[BackgroundJob],
    out: Path,
    accelerator: str,
    devices: int,
    batch: int,
    plan: str,
    cache: Path,
    max_slowdown: float,
) -> list[dict]:
    """One foreground run (the profile cache makes every auto run use the same plan)."""
    out.mkdir(parents=True, exist_ok=True)
    callbacks: list[Callback] = [BackgroundTrainers(jobs, max_slowdown=max_slowdown)] if jobs else []
    callbacks.append(StepTimes(out))
    pl.seed_everything(0)
    trainer = quiet_trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy_for(plan, devices, cache),
        max_steps=steps,
        callbacks=callbacks,
        default_root_dir=str(out),
    )
    trainer.fit(VGGLike(), DataLoader(images(batch * devices * steps), batch_size=batch))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]


def standalone_rate(
    seed: int, checkpoint_dir: Path, device: torch.device, steps: int, repeats: int = 3
) -> float:
    """The job's samples/s trained alone in this process (median of `repeats` fresh runs)."""
    rates = []
    for repeat in range(repeats):
        name = f"alone{seed}_{repeat}"
        job = BackgroundJob(
            Trial, trial_data, max_steps=steps, name=name, checkpoint_dir=checkpoint_dir, seed=seed
        )
        rates.append(run_standalone(job, device).samples_per_s)
    return statistics.median(rates)


def held_slowdown(ranks: list[dict]) -> float | None:
    """Within the shared run: the median step with jobs active over the median step with them held
    (warm-up and probe steps), from a rank that had jobs; steps take the same time on every rank.
    Immune to the machine's speed drifting between the alone and the shared run."""
    rank = next((r for r in ranks if r["active_s"]), None)
    if rank is None or not rank["held_s"]:
        return None
    return statistics.median(rank["active_s"]) / statistics.median(rank["held_s"])


def background_share(rank: dict, standalone: list[float]) -> float:
    """One rank's background work in units of a device: each job's samples over its standalone rate
    (seconds of a device trained alone), summed, over the time from the rank's first job start to
    the end of fit (jobs that ran one after the other, or side by side, count alike)."""
    ran = [row for row in rank["jobs"] if row["started_s"] is not None]
    if not ran:
        return 0.0
    seconds = rank["end_s"] - min(row["started_s"] for row in ran)
    device_s = sum(row["samples"] / standalone[int(row["name"].removeprefix("trial"))] for row in ran)
    return device_s / seconds


def measure_plan(
    plan: str, args: argparse.Namespace, accelerator: str, standalone: list[float], work: Path
) -> dict:
    """`args.runs` alternating pairs of runs (alone, with jobs) of one plan, and their medians."""
    skip = 8  # planning and the callback's warm-up steps
    runs = []
    for run in range(args.runs):
        where = work / plan
        setting = (accelerator, args.devices, args.batch, plan, work / "cache", args.max_slowdown)
        alone = foreground(args.steps, [], where / f"alone{run}", *setting)
        jobs = [
            BackgroundJob(
                Trial,
                trial_data,
                max_steps=8 * args.steps,
                name=f"trial{i}",
                checkpoint_dir=where / f"ckpt{run}",
                seed=i,
            )
            for i in range(2)
        ]
        shared = foreground(args.steps, jobs, where / f"shared{run}", *setting)
        fg_alone = statistics.median(alone[0]["times"][skip:])
        fg_shared = statistics.median(shared[0]["times"][skip:])
        normalized = [background_share(rank, standalone) for rank in shared]
        runs.append(
            {
                "foreground_step_ms_alone": fg_alone * 1e3,
                "foreground_step_ms_with_background": fg_shared * 1e3,
                "foreground_slowdown": fg_shared / fg_alone,
                "foreground_slowdown_vs_held_steps": held_slowdown(shared),
                "idle_fractions": shared[0]["idle_fractions"],
                "steps_held_by_trade_per_rank": [rank["held_by_trade"] for rank in shared],
                "background_devices_per_rank": normalized,
                "total_throughput_vs_foreground_alone": fg_alone / fg_shared + sum(normalized),
                "background_jobs": [job for rank in shared for job in rank["jobs"]],
            }
        )
        print(
            f"{plan} run {run}: " + json.dumps({k: v for k, v in runs[-1].items() if k != "background_jobs"})
        )

    def median(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    held = [r["foreground_slowdown_vs_held_steps"] for r in runs if r["foreground_slowdown_vs_held_steps"]]
    return {
        "foreground_step_ms_alone": median("foreground_step_ms_alone"),
        "foreground_step_ms_with_background": median("foreground_step_ms_with_background"),
        "foreground_slowdown": median("foreground_slowdown"),
        "foreground_slowdown_max": max(r["foreground_slowdown"] for r in runs),
        "foreground_slowdown_vs_held_steps": statistics.median(held) if held else None,
        "total_throughput_vs_foreground_alone": median("total_throughput_vs_foreground_alone"),
        "total_throughput_min": min(r["total_throughput_vs_foreground_alone"] for r in runs),
        "per_run": runs,
    }


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--plans", default="long,short", help=f"comma-separated, of {sorted(PLANS)}")
    parser.add_argument("--devices", type=int, default=(torch.cuda.device_count() if cuda else 2))
    parser.add_argument("--batch", type=int, default=16, help="foreground samples per device")
    parser.add_argument("--max-slowdown", type=float, default=1.10, help="BackgroundTrainers' limit")
    parser.add_argument("--standalone-steps", type=int, default=600, help="steps of each job trained alone")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--workdir", default="/tmp/deeppool_background_bench")
    args = parser.parse_args()
    plans = args.plans.split(",") if args.devices > 1 else ["single"]
    unknown = [plan for plan in plans if plan not in PLANS and plan != "single"]
    if unknown:
        parser.error(f"unknown plans {unknown}; choose from {sorted(PLANS)}")
    if any(os.environ.get(key) != value for key, value in FIXED_MALLOC.items()):
        # The standalone jobs run in this process: it too starts with the fixed allocator.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **FIXED_MALLOC})
    accelerator = "cuda" if cuda else "cpu"
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)  # jobs would resume from an earlier run's checkpoints
    device = torch.device(accelerator)
    standalone = [standalone_rate(i, work / "alone_ckpt", device, args.standalone_steps) for i in range(2)]
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "world_size": args.devices,
        "global_batch": args.batch * args.devices,
        "steps": args.steps,
        "runs": args.runs,
        "background_samples_per_s_alone": standalone,
        "targets": {"slowdown_at_most": args.max_slowdown, "total_at_least": 1.0},
        "plans": {plan: measure_plan(plan, args, accelerator, standalone, work) for plan in plans},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    brief = {plan: {k: v for k, v in r.items() if k != "per_run"} for plan, r in result["plans"].items()}
    print(json.dumps(brief, indent=1))


if __name__ == "__main__":
    main()
