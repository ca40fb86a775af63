"""Spatial splits on high-resolution images: deeppool against one device, and against DDP where it runs.

The model is the segmentation network of `examples/large_images.py` on 512x512 images (BatchNorm, max
pooling, a residual block, per-pixel logits at 128x128): every layer can split each sample by height.
Configurations, on CPU ranks of one thread each:
- global batch 1: `one_device`, and `deeppool` on 2 ranks with a shared batch (every rank reads the
  sample; the automatic plan splits it by height), where DDP cannot run;
- global batch 2: `one_device`, `ddp` on 2 ranks, `deeppool` on 2 ranks (automatic plan).
Each configuration runs as its own `python benchmarks/spatial.py --run` process; runs alternate and the
step time is the median over steps after warm-up, then over runs. A separate run per configuration
measures each rank's peak memory during steady steps above its memory between steps (activations and
temporaries), with every large allocation returned to the system when freed so the peak is exact.
Writes `benchmarks/results/spatial.json`.

    python benchmarks/spatial.py [--runs 3] [--steps 12] [--batches 1 2]
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
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_deeppool

from vs_ddp import FIXED_MALLOC, StepTimer, quiet_trainer

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from large_images import CLASSES, SegNet  # what is measured is the example users copy

SIZE = 512
RESULTS = Path(__file__).parent / "results" / "spatial.json"
# For the memory runs: every allocation above 64 KiB is its own mapping, returned when freed.
EXACT_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**16), "MALLOC_TRIM_THRESHOLD_": str(2**16)}


def _data(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(samples, 3, SIZE, SIZE, generator=g),
        torch.randint(0, CLASSES, (samples, SIZE // 4, SIZE // 4), generator=g),
    )


class PeakMemory(pl.Callback):
    """A rank's peak resident memory over steps `first`.. above its resident memory at their start."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.base_mb: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.first:
            self.base_mb = _status_mb("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS

    def peak_mb(self) -> float:
        assert self.base_mb is not None
        return _status_mb("VmHWM") - self.base_mb


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def run_one(config: str, batch: int, steps: int, out: Path) -> None:
    """One training run (Lightning's launcher starts the second rank by running this script again)."""
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    devices = 1 if config == "one_device" else 2
    shared = config == "deeppool" and batch < devices
    strategy: Any = {
        "one_device": "auto",
        "ddp": "ddp",
        "deeppool": lightning_deeppool.DeepPoolStrategy(shared_batch=shared, cache_dir=False),
    }[config]
    timer, memory = StepTimer(), PeakMemory(first=4)
    trainer = quiet_trainer(devices=devices, strategy=strategy, max_steps=steps, callbacks=[timer, memory])
    local = batch if shared or devices == 1 else batch // devices
    trainer.fit(SegNet(), DataLoader(_data(batch * (steps + 2)), batch_size=local))
    result: dict[str, Any] = {
        "rank": trainer.global_rank,
        "step_time_s": statistics.median(timer.times[4:]),
        "peak_activation_mb": memory.peak_mb(),
    }
    plan = getattr(trainer.strategy, "plan", None)
    if plan is not None:
        result["predicted_step_time_s"] = plan.predicted_step_time_s
        result["placements"] = {name: str(p) for name, p in plan.placements().items()}
        result["plan_table"] = plan.table()
    out.with_suffix(f".rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _launch(config: str, batch: int, steps: int, exact_memory: bool) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result"
        # One thread per rank, one device's worth (Lightning would give a lone process every core).
        env = {**os.environ, **(EXACT_MALLOC if exact_memory else FIXED_MALLOC), "OMP_NUM_THREADS": "1"}
        command = [sys.executable, __file__, "--run", config, "--batch", str(batch)]
        subprocess.run([*command, "--steps", str(steps), "--out", str(out)], check=True, env=env, cwd=folder)
        return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("result.rank*.json"))]


def configs(batch: int) -> list[str]:
    return ["one_device", "deeppool"] if batch < 2 else ["one_device", "ddp", "deeppool"]


def measure(batch: int, runs: int, steps: int) -> dict[str, Any]:
    """Step times over alternating runs, then one memory run per configuration."""
    times: dict[str, list[float]] = {config: [] for config in configs(batch)}
    predicted: dict[str, list[float]] = {config: [] for config in configs(batch)}
    plans: dict[str, Any] = {}
    for _, config in itertools.product(range(runs), configs(batch)):
        ranks = _launch(config, batch, steps, exact_memory=False)
        times[config].append(max(rank["step_time_s"] for rank in ranks))
        if "predicted_step_time_s" in ranks[0]:
            predicted[config].append(ranks[0]["predicted_step_time_s"])
            plans[config] = {"placements": ranks[0]["placements"], "table": ranks[0]["plan_table"]}
    entry: dict[str, Any] = {}
    for config in configs(batch):
        ranks = _launch(config, batch, steps, exact_memory=True)
        entry[config] = {
            "step_time_s": statistics.median(times[config]),
            "step_times_s": times[config],
            "peak_activation_mb_per_rank": [rank["peak_activation_mb"] for rank in ranks],
            **({"predicted_step_time_s": statistics.median(predicted[config])} if predicted[config] else {}),
            **plans.get(config, {}),
        }
    one = entry["one_device"]
    for config in configs(batch)[1:]:
        e = entry[config]
        e["speedup_vs_one_device"] = one["step_time_s"] / e["step_time_s"]
        e["activation_share_of_one_device"] = max(e["peak_activation_mb_per_rank"]) / max(
            one["peak_activation_mb_per_rank"]
        )
        if "predicted_step_time_s" in e:
            e["measured_over_predicted"] = e["step_time_s"] / e["predicted_step_time_s"]
        if "ddp" in entry and config == "deeppool":
            e["speedup_vs_ddp"] = entry["ddp"]["step_time_s"] / e["step_time_s"]
    return entry


def markdown_table(results: dict[str, Any]) -> str:
    lines = [
        "| global batch | configuration | step time | vs one device | vs DDP | measured / predicted "
        "| peak activations per rank (MB) | plan |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for batch, entry in sorted(results.items(), key=lambda item: int(item[0])):
        for config, e in entry.items():
            plan = " ".join(sorted(set(e.get("placements", {}).values()))) or "-"
            vs_ddp = _ratio(e.get("speedup_vs_ddp"), "x")
            fit = _ratio(e.get("measured_over_predicted"), "")
            memory = " / ".join(f"{mb:.0f}" for mb in e["peak_activation_mb_per_rank"])
            lines.append(
                f"| {batch} | {config} | {e['step_time_s'] * 1e3:.0f} ms "
                f"| {e.get('speedup_vs_one_device', 1.0):.2f}x | {vs_ddp} | {fit} | {memory} | {plan} |"
            )
    return "\n".join(lines)


def _ratio(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--run", choices=["one_device", "ddp", "deeppool"], help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_one(args.run, args.batch, args.steps, args.out)
        return
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    for batch in args.batches:
        results[str(batch)] = measure(batch, args.runs, args.steps)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    print(markdown_table(results))


if __name__ == "__main__":
    main()
