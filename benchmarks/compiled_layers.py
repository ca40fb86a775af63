"""Eager, compiled and CUDA-graphed layers side by side, on one device, where host cost is the step.

The host-cost benchmark's model (`host_overhead.Chain`: `Linear(16, 16)` layers, here 24 of them at
a batch of 8) trained under deeppool on one device, with every layer run eagerly, compiled
(`compile_layers={}`: inductor) and, on CUDA, replayed as CUDA graphs (`{"mode": "reduce-overhead"}`).
Each configuration runs in this process, one after the other, in alternation (`--runs`, default 2); a
configuration's step time is the median over steps after warm-up (compilation included in warm-up),
then the best of its runs. Writes a JSON summary (`--out`).

    python benchmarks/compiled_layers.py [--device cuda] [--steps 200] [--depth 24] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_deeppool import DeepPoolStrategy

from host_overhead import WIDTH, Chain
from vs_ddp import StepTimer, quiet_trainer

BATCH, WARMUP = 8, 20


def configurations(device: str, backend: str) -> dict[str, Any]:
    """`compile_layers` per configuration: CUDA graphs only where the device has them."""
    found: dict[str, Any] = {"eager": False, "compiled": {"backend": backend}}
    if device == "cuda":
        found["cuda graphs"] = {"backend": backend, "mode": "reduce-overhead"}
    return found


def step_time_s(device: str, compile_layers: Any, steps: int, depth: int) -> float:
    pl.seed_everything(0, verbose=False)
    timer = StepTimer()
    strategy = DeepPoolStrategy(
        cache_dir=False, profile_warmup=1, profile_repeats=1, compile_layers=compile_layers
    )
    data = TensorDataset(torch.randn(BATCH * (WARMUP + steps + 2), WIDTH))
    with tempfile.TemporaryDirectory() as root:  # where the plan is written
        trainer = quiet_trainer(
            accelerator=device,
            devices=1,
            strategy=strategy,
            max_steps=WARMUP + steps,
            callbacks=[timer],
            default_root_dir=root,
        )
        trainer.fit(Chain(depth), DataLoader(data, batch_size=BATCH))
    return statistics.median(timer.times[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--depth", type=int, default=24, help="Linear layers in the chain")
    parser.add_argument("--runs", type=int, default=2, help="alternating runs of each configuration")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "compiled_layers.json"
    )
    args = parser.parse_args()
    found = configurations(args.device, args.backend)
    times: dict[str, list[float]] = {name: [] for name in found}
    for _ in range(args.runs):
        for name, compile_layers in found.items():
            times[name].append(step_time_s(args.device, compile_layers, args.steps, args.depth))
            print(f"{name}: {times[name][-1] * 1e3:.3f} ms", flush=True)
    summary = {
        "setup": f"{args.depth} Linear({WIDTH}, {WIDTH}) layers, batch {BATCH}, one {args.device} device, "
        f"{args.steps} steps after {WARMUP}, best of {args.runs} alternating runs",
        "step_time_ms": {name: min(t) * 1e3 for name, t in times.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
