"""Background trainers: foreground step time without and with two background jobs, and throughput.

    python benchmarks/background.py [--steps 100] [--runs 7]

The VGG-like foreground of `vs_ddp.py` (cheap convolutions, 12.6M-parameter linear head, global
batch 32) on 2 ranks with its automatic plan (profiled once, then reused from a cache so every run
has the same plan), run alone and with two background jobs placed by the callback (defaults: one
slot per device, so a second job on the same rank waits for the first to finish), alternately,
`--runs` times; medians are reported. Each job is also trained alone in this process. Total
throughput = the foreground's rate over its rate alone + each rank's background work in devices
(the jobs' samples over their standalone rates, over the time the rank had jobs). CPU: gloo ranks,
idle-window mode; with CUDA the same on the GPUs, priority mode. Every process runs with the same
fixed malloc thresholds (see `vs_ddp.FIXED_MALLOC`). Writes benchmarks/results/background.json.
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

from vs_ddp import FIXED_MALLOC, StepTimer, VGGLike

RESULTS = Path(__file__).parent / "results" / "background.json"


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
            "idle_s": background.idle_step_s if background else [],
            "active_s": background.active_step_s if background else [],
            "duty": self.duties,
            "idle_fractions": background.idle_fractions if background else [],
            "end_s": time.perf_counter(),
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def foreground(steps: int, jobs: list[BackgroundJob], out: Path, accelerator: str, cache: Path) -> list[dict]:
    """One foreground run (automatic plan; the profile cache makes every run use the same plan)."""
    out.mkdir(parents=True, exist_ok=True)
    callbacks: list[Callback] = [BackgroundTrainers(jobs)] if jobs else []
    callbacks.append(StepTimes(out))
    strategy = DeepPoolStrategy(start_method="spawn", cache_dir=cache)
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=2,
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    trainer.fit(VGGLike(), DataLoader(images(16 * 2 * steps), batch_size=16))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def standalone_rate(seed: int, checkpoint_dir: Path, device: torch.device, repeats: int = 3) -> float:
    """The job's samples/s trained alone in this process (median of `repeats` fresh runs)."""
    rates = []
    for repeat in range(repeats):
        name = f"alone{seed}_{repeat}"
        job = BackgroundJob(
            Trial, trial_data, max_steps=600, name=name, checkpoint_dir=checkpoint_dir, seed=seed
        )
        rates.append(run_standalone(job, device).samples_per_s)
    return statistics.median(rates)


def held_slowdown(ranks: list[dict]) -> float | None:
    """Within the shared run: the median step with jobs active over the median step with them held
    (warm-up and probe steps), from a rank that had jobs; steps take the same time on every rank.
    Immune to the machine's speed drifting between the alone and the shared run."""
    rank = next((r for r in ranks if r["active_s"]), None)
    if rank is None or not rank["idle_s"]:
        return None
    return statistics.median(rank["active_s"]) / statistics.median(rank["idle_s"])


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--workdir", default="/tmp/deeppool_background_bench")
    args = parser.parse_args()
    if any(os.environ.get(key) != value for key, value in FIXED_MALLOC.items()):
        # The standalone jobs run in this process: it too starts with the fixed allocator.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **FIXED_MALLOC})
    cuda = torch.cuda.is_available()
    accelerator = "cuda" if cuda else "cpu"
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)  # jobs would resume from an earlier run's checkpoints
    skip = 8  # planning and the callback's warm-up steps
    device = torch.device("cuda" if cuda else "cpu")
    standalone = [standalone_rate(i, work / "alone_ckpt", device) for i in range(2)]

    runs = []
    for run in range(args.runs):
        alone = foreground(args.steps, [], work / f"alone{run}", accelerator, work / "profile")
        jobs = [
            BackgroundJob(
                Trial,
                trial_data,
                max_steps=8 * args.steps,
                name=f"trial{i}",
                checkpoint_dir=work / f"ckpt{run}",
                seed=i,
            )
            for i in range(2)
        ]
        shared = foreground(args.steps, jobs, work / f"shared{run}", accelerator, work / "profile")
        fg_alone = statistics.median(alone[0]["times"][skip:])
        fg_shared = statistics.median(shared[0]["times"][skip:])
        rows = [job for rank in shared for job in rank["jobs"]]
        normalized = [background_share(rank, standalone) for rank in shared]
        runs.append(
            {
                "foreground_step_ms_alone": fg_alone * 1e3,
                "foreground_step_ms_with_background": fg_shared * 1e3,
                "foreground_slowdown": fg_shared / fg_alone,
                "foreground_slowdown_vs_held_steps": held_slowdown(shared),
                "idle_fractions": shared[0]["idle_fractions"],
                "background_devices_per_rank": normalized,
                "total_throughput_vs_foreground_alone": fg_alone / fg_shared + sum(normalized),
                "background_jobs": rows,
            }
        )
        print(f"run {run}: " + json.dumps({k: v for k, v in runs[-1].items() if k != "background_jobs"}))

    def median(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    result = {
        "device": accelerator,
        "world_size": 2,
        "global_batch": 32,
        "steps": args.steps,
        "runs": args.runs,
        "foreground_step_ms_alone": median("foreground_step_ms_alone"),
        "foreground_step_ms_with_background": median("foreground_step_ms_with_background"),
        "foreground_slowdown": median("foreground_slowdown"),
        "foreground_slowdown_max": max(r["foreground_slowdown"] for r in runs),
        "foreground_slowdown_vs_held_steps": statistics.median(
            r["foreground_slowdown_vs_held_steps"] for r in runs if r["foreground_slowdown_vs_held_steps"]
        ),
        "background_samples_per_s_alone": standalone,
        "total_throughput_vs_foreground_alone": median("total_throughput_vs_foreground_alone"),
        "total_throughput_min": min(r["total_throughput_vs_foreground_alone"] for r in runs),
        "targets": {"slowdown_at_most": 1.10, "total_at_least": 1.3},
        "per_run": runs,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "per_run"}, indent=1))


if __name__ == "__main__":
    main()
