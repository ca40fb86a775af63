"""Peak memory per rank: Lightning's "ddp" against "deeppool" (automatic plan; "deeppool-cached": the
same with its profile cached by an earlier run, as on every run after a machine's first) on
`vs_ddp.py`'s VGG-like model (a 12.6M-parameter linear head, 99.8% of the parameters, which the plan
runs on rank 0 alone), 2 CPU ranks (one thread each), global batch 32, SGD with momentum, glibc's
default malloc settings (a user's: a freed large tensor goes back to the system; `vs_ddp.py`'s fixed
thresholds, which steady its timings, keep freed memory in the heap and so hide what a rank stops
holding). Runs alternate between the configurations; per rank, the median over runs of:

- `peak_rss_mb`: the process's peak resident set over the whole run (start-up, profiling and planning
  included): the larger of the peak before the reset below and the peak after it;
- `after_install_mb`: the peak at the end of the first step (the plan is profiled and installed in it);
- `training_peak_mb`: the peak over the steps after the fifth (the peak is reset there, through
  `/proc/self/clear_refs`), when training holds what it holds at every step.

Writes `benchmarks/results/memory.json`.

    python benchmarks/memory.py [--runs 3] [--steps 30]
"""

from __future__ import annotations

import argparse
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

from vs_ddp import FIXED_MALLOC, VGGLike, quiet_trainer

RESULTS = Path(__file__).parent / "results" / "memory.json"
CONFIGS = ("ddp", "deeppool", "deeppool-cached")
RESET_AFTER = 5  # steps


def _hwm_mb() -> float:
    """This process's peak resident set since start or the last reset (VmHWM), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class Peaks(pl.Callback):
    """The peaks the module docstring names, recorded at the ends of steps."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}
        self._before_reset = 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step == 1:
            self.peaks["after_install_mb"] = _hwm_mb()
        if step == RESET_AFTER:
            self._before_reset = _hwm_mb()
            # resets VmHWM (and ru_maxrss, which reads it) to the current resident set
            Path("/proc/self/clear_refs").write_text("5")
        if step == trainer.max_steps:
            self.peaks["training_peak_mb"] = _hwm_mb()
            self.peaks["peak_rss_mb"] = max(self._before_reset, self.peaks["training_peak_mb"])


def run_one(config: str, steps: int, out: Path, cache_dir: Path) -> None:
    """One training run (the launcher starts the second rank by running this script again);
    "deeppool-cached" reads and writes its profile in `cache_dir`."""
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    samples = 32 * (steps + 2)
    data = TensorDataset(torch.randn(samples, 3, 32, 32), torch.randint(0, 10, (samples,)))
    strategy: Any = "ddp"
    if config != "ddp":
        cached = cache_dir if config == "deeppool-cached" else False
        strategy = lightning_deeppool.DeepPoolStrategy(cache_dir=cached)
    peaks = Peaks()
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=steps, callbacks=[peaks])
    trainer.fit(VGGLike(), DataLoader(data, batch_size=16))
    out.with_suffix(f".rank{trainer.global_rank}.json").write_text(json.dumps(peaks.peaks))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--run", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_one(args.run, args.steps, args.out, args.cache_dir)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for name in FIXED_MALLOC:
        env.pop(name, None)
    samples: dict[str, list[list[dict[str, float]]]] = {config: [] for config in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        cache = ["--cache-dir", str(Path(tmp) / "profiles")]
        warm = [
            sys.executable,
            __file__,
            "--run",
            "deeppool-cached",
            "--steps",
            "2",
            "--out",
            str(Path(tmp) / "warm"),
        ]
        subprocess.run([*warm, *cache], env=env, cwd=tmp, stdout=subprocess.DEVNULL, check=True)
        for run in range(args.runs):
            for config in CONFIGS:
                out = Path(tmp) / f"{config}-{run}"
                cmd = [sys.executable, __file__, "--run", config, "--steps", str(args.steps), *cache]
                subprocess.run([*cmd, "--out", str(out)], env=env, cwd=tmp, stdout=subprocess.DEVNULL)
                ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob(f"{out.name}.rank*.json"))]
                if len(ranks) < 2:
                    raise RuntimeError(f"run {run} of {config} failed")
                samples[config].append(ranks)
                print(f"run {run} {config}: {ranks}", flush=True)
    head = VGGLike().head
    result: dict[str, Any] = {
        "setup": f"2 CPU ranks (1 thread each), gloo, global batch 32, VGG-like, SGD with momentum, glibc "
        f"malloc defaults, {args.steps} steps, {args.runs} alternating runs",
        "head_parameter_mb": sum(p.numel() * p.element_size() for p in head.parameters()) / 2**20,
    }
    result["cached_profile"] = "deeppool-cached read the profile a 2-step run before the measured runs wrote"
    for config, runs in samples.items():
        result[config] = {
            key: [statistics.median(r[rank][key] for r in runs) for rank in range(2)] for key in runs[0][0]
        }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
