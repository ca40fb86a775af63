"""What `DeepPoolStrategy(current_weights=True)` costs: the VGG-like model of `vs_ddp.py` on 2 CPU ranks
(one thread each, global batch 32) with its head pinned to rank 0 alone, the automatic plan's
placement, so both configurations run the same plan; rank 0 then sends rank 1 the head's 12.6M fp32
weights (48 MiB) after every optimizer step. Runs alternate between the option off and on; the cost is
the median over runs of each pair's difference in step time (the slowest rank's median over steps
after warm-up). Writes `benchmarks/results/current_weights.json`.

    python benchmarks/current_weights.py [--runs 4] [--steps 40]
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

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_deeppool

from vs_ddp import FIXED_MALLOC, StepTimer, VGGLike, quiet_trainer

RESULTS = Path(__file__).parent / "results" / "current_weights.json"
PLAN = {"": 2, "head": 1}
CONFIGS = {"off": False, "on": True}


def run_one(config: str, steps: int, out: Path) -> None:
    """One training run (the launcher starts the second rank by running this script again)."""
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    samples = 32 * (steps + 2)
    data = TensorDataset(torch.randn(samples, 3, 32, 32), torch.randint(0, 10, (samples,)))
    current = CONFIGS[config]
    strategy = lightning_deeppool.DeepPoolStrategy(plan=PLAN, cache_dir=False, current_weights=current)
    timer = StepTimer()
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=steps, callbacks=[timer])
    trainer.fit(VGGLike(), DataLoader(data, batch_size=16))
    out.with_suffix(f".rank{trainer.global_rank}.json").write_text(
        json.dumps({"step_time_s": statistics.median(timer.times[5:])})
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--run", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_one(args.run, args.steps, args.out)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **FIXED_MALLOC}
    times: dict[str, list[float]] = {config: [] for config in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for config in CONFIGS:
                out = Path(tmp) / f"{config}-{run}"
                cmd = [sys.executable, __file__, "--run", config, "--steps", str(args.steps)]
                subprocess.run([*cmd, "--out", str(out)], env=env, cwd=tmp, stdout=subprocess.DEVNULL)
                ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob(f"{out.name}.rank*.json"))]
                if len(ranks) < 2:
                    raise RuntimeError(f"run {run} with current_weights {config} failed")
                times[config].append(max(r["step_time_s"] for r in ranks) * 1e3)
                print(f"run {run} current_weights {config}: {times[config][-1]:.1f} ms", flush=True)
    cost = statistics.median(on - off for on, off in zip(times["on"], times["off"]))
    result = {
        "setup": "2 CPU ranks (1 thread each), gloo, global batch 32, VGG-like, plan " + json.dumps(PLAN),
        "step_time_ms": {config: statistics.median(t) for config, t in times.items()},
        "step_times_ms_per_run": times,
        "cost_ms_per_step": cost,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
