"""Branches side by side on disjoint devices: Lightning's "ddp" against deeppool's automatic plan
without branch parallelism (``branches=False``) and with it, on CPU ranks (one thread each; 2 by
default, ``--devices 4`` shares this machine's 2 cores among 4 ranks).

Models, global batch 32:
- `towers`: CLIP-style, an image tower (two convolutions, pooled: compute, 0.03M parameters) and a
  text tower (an embedding and a 4.7M-parameter MLP) up to a contrastive loss over each rank's batch;
- `inception`: a stem, then an Inception-style block (1x1, 3x3 and pooled 1x1 branches, wide
  convolutions) and a 1.6M-parameter linear head.
Each configuration runs as its own process (Lightning's launcher starts the other ranks); runs
alternate between configurations and a run's step time is the median over steps after warm-up (the
slower rank's). Each run profiles and plans afresh, so plans may differ between runs: the results
(`benchmarks/results/branches.json`) keep every run's step time, prediction and plan, and the
medians over runs.

    python benchmarks/branches.py [--models towers] [--devices 2] [--runs 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_deeppool

from vs_ddp import FIXED_MALLOC, StepTimer, quiet_trainer

CONFIGS = ("ddp", "no_branches", "branches")
RESULTS = Path(__file__).parent / "results" / "branches.json"
VOCAB, TOKENS, BATCH = 1000, 16, 32


class Towers(pl.LightningModule):
    """An image tower and a text tower, independent up to a contrastive loss."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 512),
        )  # fmt: skip
        self.text = nn.Sequential(
            nn.Embedding(VOCAB, 256),
            nn.Flatten(),
            nn.Linear(256 * TOKENS, 1024),
            nn.GELU(),
            nn.Linear(1024, 512),
        )

    def forward(self, images: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.normalize(self.image(images), dim=-1), F.normalize(self.text(ids), dim=-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        image, text = self(*batch)
        logits = 10 * image @ text.T
        labels = torch.arange(len(logits))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Inception(pl.LightningModule):
    """A stem, an Inception-style block of three branches, concatenated, and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU())
        self.one = nn.Sequential(nn.Conv2d(32, 32, 1), nn.ReLU())
        self.three = nn.Sequential(
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1)
        )
        self.pooled = nn.Sequential(nn.AvgPool2d(3, 1, 1), nn.Conv2d(32, 32, 1), nn.ReLU())
        self.head = nn.Linear(96 * 16 * 16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return self.head(torch.cat([self.one(x), self.three(x), self.pooled(x)], 1).flatten(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _pairs(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(samples, 3, 16, 16, generator=g), torch.randint(0, VOCAB, (samples, TOKENS), generator=g)
    )


def _images(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(samples, 3, 16, 16, generator=g), torch.randint(0, 64, (samples,), generator=g)
    )


MODELS = {"towers": (Towers, _pairs), "inception": (Inception, _images)}


def run_one(model_name: str, config: str, devices: int, steps: int, out: Path) -> None:
    """One training run (the launcher starts the second rank by running this script again)."""
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    make_model, make_data = MODELS[model_name]
    strategy: Any = (
        "ddp"
        if config == "ddp"
        else lightning_deeppool.DeepPoolStrategy(branches=config == "branches", cache_dir=False)
    )
    timer = StepTimer()
    trainer = quiet_trainer(devices=devices, strategy=strategy, max_steps=steps, callbacks=[timer])
    trainer.fit(make_model(), DataLoader(make_data(BATCH * (steps + 2)), batch_size=BATCH // devices))
    result: dict[str, Any] = {"rank": trainer.global_rank, "step_time_s": statistics.median(timer.times[5:])}
    plan = getattr(trainer.strategy, "plan", None)
    if plan is not None:
        result["predicted_step_time_s"] = plan.predicted_step_time_s
        result["placements"] = {name: str(p) for name, p in plan.placements().items()}
        result["plan_table"] = plan.table()
    out.with_suffix(f".rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _launch(model_name: str, config: str, devices: int, steps: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result"
        env = {**os.environ, **FIXED_MALLOC, "OMP_NUM_THREADS": "1"}
        command = [
            sys.executable,
            __file__,
            "--model",
            model_name,
            "--run",
            config,
            "--devices",
            str(devices),
        ]
        command += ["--steps", str(steps)]
        subprocess.run(
            [*command, "--out", str(out)], check=True, env=env, cwd=folder, stdout=subprocess.DEVNULL
        )
        return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("result.rank*.json"))]


def measure(model_name: str, devices: int, runs: int, steps: int) -> dict[str, Any]:
    """Alternating runs of every configuration; per configuration each run's step time (the slower
    rank's), prediction and plan (its distinct placements), and the medians of the runs."""
    entry: dict[str, Any] = {config: {"runs": []} for config in CONFIGS}
    for _, config in itertools.product(range(runs), CONFIGS):
        ranks = _launch(model_name, config, devices, steps)
        run = {"step_time_s": max(rank["step_time_s"] for rank in ranks)}
        if "placements" in ranks[0]:
            run["predicted_step_time_s"] = ranks[0]["predicted_step_time_s"]
            run["plan"] = plan_summary(ranks[0]["placements"])
            entry[config]["plan_table"] = ranks[0]["plan_table"]  # the last run's
        entry[config]["runs"].append(run)
    ddp_s = statistics.median(run["step_time_s"] for run in entry["ddp"]["runs"])
    for config in CONFIGS:
        e = entry[config]
        e["step_time_s"] = statistics.median(run["step_time_s"] for run in e["runs"])
        e["speedup_vs_ddp"] = ddp_s / e["step_time_s"]
        if config != "ddp":
            ratios = [run["step_time_s"] / run["predicted_step_time_s"] for run in e["runs"]]
            e["measured_over_predicted"] = statistics.median(ratios)
    return entry


def plan_summary(placements: dict[str, str]) -> str:
    """Each module's placement, the top-level modules only: ``image: 1@1, text: 1``."""
    modules: dict[str, set[str]] = {}
    for name, placement in placements.items():
        modules.setdefault(name.split("_")[0], set()).add(placement)
    return ", ".join(f"{module}: {'/'.join(sorted(found))}" for module, found in modules.items())


def markdown_table(results: dict[str, Any]) -> str:
    lines = [
        "| model, devices | configuration | step time | vs DDP | measured / predicted | plans (runs) |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for name, entry in results.items():
        for config in CONFIGS:
            e = entry[config]
            ratio = f"{e['measured_over_predicted']:.2f}" if "measured_over_predicted" in e else "-"
            plans = Counter(run["plan"] for run in e["runs"] if "plan" in run)
            shown = "; ".join(f"{plan} ({count})" for plan, count in plans.most_common()) or "-"
            lines.append(
                f"| {name} | {config} | {e['step_time_s'] * 1e3:.1f} ms | {e['speedup_vs_ddp']:.2f}x "
                f"| {ratio} | {shown} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--run", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_one(args.model, args.run, args.devices, args.steps, args.out)
        return
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for model_name in args.models:
        results[f"{model_name} on {args.devices}"] = measure(model_name, args.devices, args.runs, args.steps)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=1))
    print(markdown_table(results))


if __name__ == "__main__":
    main()
