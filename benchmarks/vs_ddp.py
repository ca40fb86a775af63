"""Lightning's "ddp" against "deeppool" (automatic plan) and deeppool at full width, side by side; also
DDP's best CPU configuration (`static_graph=True, gradient_as_bucket_view=True`; Lightning's DDP
applies no communication hook on CPU).

Models, each at global batch 32 on 2 CPU ranks (one thread each):
- `vgg`: a VGG-like model (cheap convolutions, a 12.6M-parameter linear head): communication-bound;
- `convhead`: four 3x3 convolutions and a 13.1M-parameter linear head: communication-bound;
- `compute`: five 3x3 convolutions at 32x32, 0.3M parameters: compute-bound, DDP is near-optimal;
- `resnet`: a residual network with BatchNorm (three blocks), small parameters;
- `gpt`: Hugging Face GPT-2 (2 layers, width 128) with a 32k-token vocabulary, its embedding tied
  to the output head (4.1M parameters there), on 32-token sequences.
Each configuration runs as its own `python benchmarks/vs_ddp.py --run` process (Lightning's popen
launcher starts the second rank); runs alternate between configurations and the steady-state step
time is the median over steps after warm-up, then over runs. Writes `benchmarks/results/vs_ddp.json`
with, per model and configuration, step times, the plan's prediction and table, and peak memory.

    python benchmarks/vs_ddp.py [--models vgg gpt] [--runs 5] [--steps 60]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_deeppool
from lightning_deeppool.ir.placement import equal_width_runs

CONFIGS = ("ddp", "deeppool", "deeppool_full_width", "ddp_tuned")
DDP_TUNED = {"static_graph": True, "gradient_as_bucket_view": True}
RESULTS = Path(__file__).parent / "results" / "vs_ddp.json"


class VGGLike(pl.LightningModule):
    """Small convolutions on 32x32 images, then a 16384 -> 768 linear layer (12.6M params)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 16 * 16, 768), nn.ReLU(), nn.Linear(768, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class ImageClassifier(pl.LightningModule):
    """Cross-entropy on 32x32 images; SGD with momentum. Subclasses define `net`."""

    net: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _convs(channels: list[int]) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for c_in, c_out in itertools.pairwise(channels):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU()]
    return layers


class ConvHead(ImageClassifier):
    """Four 3x3 convolutions on 32x32 images, then a 16384 -> 800 linear layer (13.1M params)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            *_convs([3, 32, 32, 32, 16]),
            nn.Flatten(),
            nn.Linear(16 * 32 * 32, 800),
            nn.ReLU(),
            nn.Linear(800, 10),
        )


class ComputeBound(ImageClassifier):
    """Five 3x3 convolutions (32 channels) at 32x32, pooling and a small classifier: 0.3M params."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            *_convs([3, 32, 32, 32, 32, 32]),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 16 * 16, 32),
            nn.ReLU(),
            nn.Linear(32, 10),
        )


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResidualNet(ImageClassifier):
    """A stem, three residual blocks at 16x16 with BatchNorm, global pooling, a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            *(Block(32) for _ in range(3)),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )


class GPTLanguageModel(pl.LightningModule):
    """Hugging Face GPT-2: 2 layers of width 128, a 32k vocabulary, tied embedding and head."""

    vocab = 32000

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=self.vocab, n_positions=32, n_embd=128, n_layer=2, n_head=4, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        self.model = GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        logits = self(ids)[:, :-1]
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab), ids[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _images(samples: int) -> TensorDataset:
    return TensorDataset(torch.randn(samples, 3, 32, 32), torch.randint(0, 10, (samples,)))


def _tokens(samples: int) -> TensorDataset:
    return TensorDataset(torch.randint(0, GPTLanguageModel.vocab, (samples, 32)))


MODELS = {
    "vgg": (VGGLike, _images, "VGG-like, 12.6M-param head"),
    "convhead": (ConvHead, _images, "four 3x3 convolutions, 13.1M-param head"),
    "compute": (ComputeBound, _images, "five 3x3 convolutions at 32x32, 0.3M params"),
    "resnet": (ResidualNet, _images, "residual network with BatchNorm, 3 blocks at 16x16"),
    "gpt": (
        GPTLanguageModel,
        _tokens,
        "HF GPT-2, 2 layers x 128, 32k vocabulary tied to the head, 32 tokens",
    ),
}


class StepTimer(pl.Callback):
    """Wall time between consecutive training-batch starts (everything a step costs)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    """A Trainer that only trains (no logger, checkpoints, progress bar or summary), on CPU unless
    `accelerator` says otherwise: what every benchmark measures under."""
    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    return pl.Trainer(**{"accelerator": "cpu", **quiet, "enable_model_summary": False, **kwargs})


# Profiling frees large blocks, after which glibc raises its mmap threshold for the rest of the
# process: a run that profiled would allocate faster than one that did not (20% of a step here).
# Fixed thresholds give every configuration the same allocator.
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**28), "MALLOC_TRIM_THRESHOLD_": str(2**28)}


def run_one(model_name: str, config: str, steps: int, out: Path) -> None:
    """One training run (the launcher starts the second rank by running this script again)."""
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    make_model, make_data, _ = MODELS[model_name]
    data = make_data(16 * 2 * (steps + 2))
    if config.startswith("ddp"):
        strategy: object = DDPStrategy(**DDP_TUNED) if config == "ddp_tuned" else "ddp"
    else:
        plan = {"": 2} if config == "deeppool_full_width" else None
        strategy = lightning_deeppool.DeepPoolStrategy(plan=plan, cache_dir=False)
    timer = StepTimer()
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=steps, callbacks=[timer])
    trainer.fit(make_model(), DataLoader(data, batch_size=16))
    warm = timer.times[5:]
    result = {
        "config": config,
        "rank": trainer.global_rank,
        "step_time_s": statistics.median(warm),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    plan_obj = getattr(trainer.strategy, "plan", None)
    if plan_obj is not None:
        result["work_time_s"] = trainer.strategy.measured_work_time_s
        result["predicted_step_time_s"] = plan_obj.predicted_step_time_s
        result["widths"] = plan_obj.widths()
        result["plan_table"] = plan_obj.table()
        result["predicted_speedup"] = plan_obj.speedup
    per_rank = out.with_suffix(f".rank{trainer.global_rank}.json")
    per_rank.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--run", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_one(args.model, args.run, args.steps, args.out)
        return

    known = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results = {name: summary for name, summary in known.items() if name in MODELS}
    for model_name in args.models:
        results[model_name] = _measure(model_name, args.runs, args.steps)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=1))
    print(markdown_table(results))
    print(options_table(results))


def markdown_table(results: dict) -> str:
    """The README's results table: per model, DDP against the automatic plan and full width."""
    lines = [
        "| model | DDP | automatic plan | vs DDP | predicted vs DDP | measured / predicted: plan's work; "
        "whole step | full width vs DDP | peak RSS per rank (MB): DDP; plan | plan widths |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for name, summary in results.items():
        ddp, auto, full = summary["ddp"], summary["deeppool"], summary["deeppool_full_width"]
        memory = "; ".join(" / ".join(f"{mb:.0f}" for mb in e["peak_rss_mb_per_rank"]) for e in (ddp, auto))
        lines.append(
            f"| {MODELS[name][2]} | {ddp['step_time_ms']:.1f} ms | {auto['step_time_ms']:.1f} ms "
            f"| {auto['speedup_vs_ddp']:.2f}x | {_predicted_speedup(auto):.2f}x | "
            f"{auto['work_over_predicted']:.2f}; {auto['measured_over_predicted']:.2f} "
            f"| {full['speedup_vs_ddp']:.2f}x | {memory} | {_runs(auto['widths'])} |"
        )
    return "\n".join(lines)


def options_table(results: dict) -> str:
    """The README's second table, for models measured with every configuration: the automatic plan
    against DDP's defaults and its best CPU options, from the same alternating runs."""
    lines = [
        "| model | DDP | DDP, static graph + bucket view | automatic plan | vs DDP | vs best DDP |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, summary in results.items():
        if not set(CONFIGS) <= set(summary):
            continue
        ddp, tuned, auto = (summary[c]["step_time_ms"] for c in ("ddp", "ddp_tuned", "deeppool"))
        lines.append(
            f"| {MODELS[name][2]} | {ddp:.1f} ms | {tuned:.1f} ms | {auto:.1f} ms | {ddp / auto:.2f}x "
            f"| {tuned / auto:.2f}x |"
        )
    return "\n".join(lines)


def _predicted_speedup(entry: dict) -> float:
    if "predicted_speedup" in entry:
        return entry["predicted_speedup"]
    footer = next(line for line in entry["plan_table"].splitlines() if line.startswith("predicted step time"))
    return float(footer.split("speedup ")[1].split("x")[0])


def _runs(widths: dict[str, int]) -> str:
    """``a..c: 2, d: 1``: consecutive layers of one width as a range."""
    runs = equal_width_runs(widths, widths)
    return ", ".join(f"{run[0]}{'..' + run[-1] if len(run) > 1 else ''}: {widths[run[0]]}" for run in runs)


def _measure(model_name: str, runs: int, steps: int) -> dict:
    """Alternating runs of every configuration; their summary."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **FIXED_MALLOC}
    samples: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(runs):
            for config in CONFIGS:
                out = Path(tmp) / f"{config}-{run}"
                cmd = [sys.executable, __file__, "--model", model_name, "--run", config]
                cmd += ["--steps", str(steps), "--out", str(out)]
                done = subprocess.run(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL)
                files = sorted(Path(tmp).glob(f"{config}-{run}.rank*.json"))
                if len(files) < 2:  # a crash at exit, after both ranks wrote their results, is harmless
                    raise RuntimeError(
                        f"{model_name} {config} run {run} failed (exit code {done.returncode})"
                    )
                ranks = [json.loads(p.read_text()) for p in files]
                samples[config].append({"ranks": ranks})
                times = ", ".join(f"{r['step_time_s'] * 1e3:.1f} ms" for r in ranks)
                if "predicted_step_time_s" in ranks[0]:
                    times += f"; work {max(r['work_time_s'] for r in ranks) * 1e3:.1f} ms, predicted "
                    times += f"{ranks[0]['predicted_step_time_s'] * 1e3:.1f} ms"
                print(f"{model_name} run {run} {config}: {times}", flush=True)
    return _summarize(model_name, samples)


def _summarize(model_name: str, samples: dict[str, list[dict]]) -> dict:
    def step_time(config: str) -> float:
        # A step ends when the slowest rank ends: take the max over ranks, the median over runs.
        return statistics.median(max(r["step_time_s"] for r in s["ranks"]) for s in samples[config])

    def peak_rss(config: str) -> list[float]:
        ranks = len(samples[config][0]["ranks"])
        runs = samples[config]
        return [statistics.median(s["ranks"][i]["peak_rss_mb"] for s in runs) for i in range(ranks)]

    ddp = step_time("ddp")
    summary: dict = {"setup": f"2 CPU ranks (1 thread each), gloo, global batch 32, {MODELS[model_name][2]}"}
    for config in CONFIGS:
        entry = {"step_time_ms": step_time(config) * 1e3, "speedup_vs_ddp": ddp / step_time(config)}
        entry["peak_rss_mb_per_rank"] = peak_rss(config)
        predicted = [s["ranks"][0].get("predicted_step_time_s") for s in samples[config]]
        if predicted[0] is not None:
            entry["predicted_step_time_ms"] = statistics.median(predicted) * 1e3
            entry["measured_over_predicted"] = step_time(config) / statistics.median(predicted)
            work = statistics.median(max(r["work_time_s"] for r in s["ranks"]) for s in samples[config])
            entry["work_time_ms"] = work * 1e3
            entry["work_over_predicted"] = work / statistics.median(predicted)
            entry["widths"] = samples[config][-1]["ranks"][0]["widths"]
            entry["plan_table"] = samples[config][-1]["ranks"][0]["plan_table"]
            speedups = [s["ranks"][0].get("predicted_speedup") for s in samples[config]]
            if speedups[0] is not None:
                entry["predicted_speedup"] = statistics.median(speedups)
        summary[config] = entry
    return summary


if __name__ == "__main__":
    main()
