"""The runtime's host cost: step times on a model whose compute is negligible, and what a step calls.

`depth` layers of `Linear(16, 16)`, 2 samples per rank, 2 CPU ranks (one thread each), SGD, at 8 and
24 layers. Configurations: one process without a strategy (the global batch of 4), Lightning's DDP,
deeppool at full width, deeppool with the last layer at width 1 (two width changes a step) and with
every fourth layer at width 1 (several). Each run is its own process (Lightning's launcher starts the
second rank); runs alternate between configurations; a configuration's step time is the median over
steps after warm-up, the slowest rank's, then the median over runs. The per-layer slope is the step
time's growth from 8 to 24 layers over 16.

A separate, untimed run of each configuration counts what one steady-state step calls, by call site
(the first frame outside torch): collectives of `torch.distributed`, the ranks' meetings
(`CallAgreement`), round trips to the process group's key-value store, and the host reads of tensor
values (`item`, `tolist`, `__bool__`, `cpu`, `numpy`) that on a GPU wait for the device; and the time
a step spends checking what its captured forward depended on (`ModuleState.current`: module values
and forward hooks, read at every planned call).

    python benchmarks/host_overhead.py [--depths 8 24] [--runs 5] [--steps 300]

Writes `benchmarks/results/host_overhead.json` and prints the README's table.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_deeppool
from lightning_deeppool.capture.state import ModuleState
from lightning_deeppool.session.call_agreement import CallAgreement

from vs_ddp import FIXED_MALLOC, StepTimer, quiet_trainer

CONFIGS = ("one_process", "ddp", "deeppool_full_width", "deeppool_last_narrow", "deeppool_several_narrow")
RESULTS = Path(__file__).parent / "results" / "host_overhead.json"
LOCAL_BATCH, WIDTH = 2, 16
WARMUP, COUNTED = 20, 10  # steps before counting starts; steps counted
# isend and irecv are left alone (P2POp checks them by identity): batch_isend_irecv counts their batches.
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier",
    "send", "recv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list",
)  # fmt: skip
STORE_CALLS = ("get", "set", "add", "wait", "check", "compare_set", "multi_get", "multi_set", "delete_key")
HOST_READS = ("item", "tolist", "__bool__", "cpu", "numpy")


class Chain(pl.LightningModule):
    """`depth` linear layers of width 16; the mean square of the output is the loss."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self(x).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def pins(config: str, depth: int) -> dict[str, int]:
    """The plan of a deeppool configuration: everything at width 2 but its narrow layers."""
    narrow = {"deeppool_last_narrow": [depth - 1], "deeppool_several_narrow": list(range(3, depth, 4))}
    return {"": 2, **{f"layers.{i}": 1 for i in narrow.get(config, [])}}


class Counts:
    """Calls by kind and call site, recorded while `counting` is set."""

    def __init__(self) -> None:
        self.counting = False
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.guard_s = 0.0

    def timed(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = function(*args, **kwargs)
            if self.counting:
                self.guard_s += time.perf_counter() - start
            return result

        return timed

    def wrap(self, kind: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.counting:
                self.calls[(kind, _call_site())] += 1
            return function(*args, **kwargs)

        return counted


def _call_site() -> str:
    """The first frame outside torch and this file: ``path:line`` from the package's folder."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in name and name != __file__:
            parts = Path(name).parts
            start = next((i for i, p in enumerate(parts) if p in ("lightning_deeppool", "lightning")), -1)
            return f"{'/'.join(parts[start:]) if start >= 0 else Path(name).name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def instrument(counts: Counts) -> None:
    """Count collectives, store round trips and host reads of tensor values from here on."""
    for name in COLLECTIVES:
        setattr(dist, name, counts.wrap(f"collective {name}", getattr(dist, name)))
    for name in HOST_READS:
        setattr(torch.Tensor, name, counts.wrap(f"host read {name}", getattr(torch.Tensor, name)))
    for store in (dist.PrefixStore, dist.TCPStore):
        for name in STORE_CALLS:
            setattr(store, name, counts.wrap(f"store {name}", getattr(store, name)))
    CallAgreement._meet = counts.wrap("meeting", CallAgreement._meet)  # type: ignore[method-assign]
    ModuleState.current = counts.timed(ModuleState.current)  # type: ignore[method-assign]


class _CountSteadySteps(pl.Callback):
    """Turns counting on for `COUNTED` steps after `WARMUP`."""

    def __init__(self, counts: Counts) -> None:
        self.counts = counts

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.counts.counting = WARMUP <= trainer.global_step < WARMUP + COUNTED


def run_one(config: str, depth: int, steps: int, count: bool, out: Path) -> None:
    """One run (as rank 0 of two, Lightning's launcher runs this script again for rank 1)."""
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    counts = Counts()
    if count:
        instrument(counts)
        steps = WARMUP + COUNTED + 1
    devices = 1 if config == "one_process" else 2
    strategy: Any = {"one_process": "auto", "ddp": "ddp"}.get(config) or lightning_deeppool.DeepPoolStrategy(
        plan=pins(config, depth), cache_dir=False
    )
    timer = StepTimer()
    trainer = quiet_trainer(
        devices=devices, strategy=strategy, max_steps=steps, callbacks=[timer, _CountSteadySteps(counts)]
    )
    data = TensorDataset(torch.randn(LOCAL_BATCH * 2 * (steps + 2), WIDTH))
    trainer.fit(Chain(depth), DataLoader(data, batch_size=LOCAL_BATCH * 2 // devices))
    result: dict[str, Any] = {
        "rank": trainer.global_rank,
        "step_time_s": statistics.median(timer.times[WARMUP:]),
    }
    if count:
        result["per_step"] = {
            f"{kind} @ {site}": n / COUNTED for (kind, site), n in sorted(counts.calls.items())
        }
        result["guard_us_per_step"] = counts.guard_s / COUNTED * 1e6
    out.with_suffix(f".rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _launch(config: str, depth: int, steps: int, count: bool, out: Path, tmp: str) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **FIXED_MALLOC}
    cmd = [sys.executable, __file__, "--run", config, "--depth", str(depth), "--steps", str(steps)]
    cmd += ["--out", str(out)] + (["--count"] if count else [])
    done = subprocess.run(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL)
    files = sorted(Path(tmp).glob(f"{out.name}.rank*.json"))
    if len(files) < (1 if config == "one_process" else 2):
        raise RuntimeError(f"{config} at depth {depth} failed (exit code {done.returncode})")
    return [json.loads(p.read_text()) for p in files]


def measure(depths: list[int], runs: int, steps: int) -> dict[str, Any]:
    """Alternating timed runs of every configuration at every depth, then one counted run of each."""
    times: dict[str, dict[int, list[float]]] = {c: {d: [] for d in depths} for c in CONFIGS}
    counted: dict[str, dict[str, float]] = {}
    guards: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(runs):
            for depth in depths:
                for config in CONFIGS:
                    ranks = _launch(config, depth, steps, False, Path(tmp) / f"{config}-{depth}-{run}", tmp)
                    times[config][depth].append(max(r["step_time_s"] for r in ranks))
                    print(
                        f"run {run} depth {depth} {config}: {times[config][depth][-1] * 1e3:.2f} ms",
                        flush=True,
                    )
        for config in CONFIGS:
            ranks = _launch(config, max(depths), steps, True, Path(tmp) / f"{config}-counted", tmp)
            counted[config] = ranks[0]["per_step"]
            guards[config] = ranks[0]["guard_us_per_step"]
    summary: dict[str, Any] = {
        "setup": f"2 CPU ranks (1 thread each), gloo, Linear({WIDTH}, {WIDTH}) layers, {LOCAL_BATCH} samples "
        f"per rank, {steps} steps a run (median after {WARMUP}), {runs} alternating runs",
        "configs": {},
    }
    for config in CONFIGS:
        median = {d: statistics.median(times[config][d]) * 1e3 for d in depths}
        entry: dict[str, Any] = {"step_time_ms": median, "spread_ms": _spread(times[config])}
        if len(depths) > 1:
            entry["per_layer_us"] = (
                (median[max(depths)] - median[min(depths)]) / (max(depths) - min(depths)) * 1e3
            )
        entry[f"per_step_at_{max(depths)}_layers"] = counted[config]
        entry[f"guard_us_per_step_at_{max(depths)}_layers"] = guards[config]
        summary["configs"][config] = entry
    return summary


def _spread(times: dict[int, list[float]]) -> dict[int, float]:
    return {d: (max(t) - min(t)) * 1e3 for d, t in times.items()}


def markdown_table(summary: dict[str, Any]) -> str:
    """Step times per depth, the per-layer slope, and totals per step by kind at the largest depth."""
    configs = summary["configs"]
    depths = sorted(int(d) for d in next(iter(configs.values()))["step_time_ms"])
    kinds = ("collective", "meeting", "store", "host read")
    head = " | ".join(
        [
            *(f"step, {d} layers" for d in depths),
            "per layer",
            *(f"{k}s / step" for k in kinds),
            "guard checks / step",
        ]
    )
    lines = [f"| configuration | {head} |", "| --- |" + " ---: |" * (len(depths) + 2 + len(kinds))]
    for config, entry in configs.items():
        steps = [f"{entry['step_time_ms'][str(d)]:.2f} ms" for d in depths]
        slope = f"{entry['per_layer_us']:.0f} us" if "per_layer_us" in entry else "-"
        calls = entry[f"per_step_at_{max(depths)}_layers"]
        totals = [f"{sum(n for key, n in calls.items() if key.startswith(kind)):g}" for kind in kinds]
        guard = f"{entry.get(f'guard_us_per_step_at_{max(depths)}_layers', 0.0):.1f} us"
        lines.append(f"| {config.replace('_', ' ')} | {' | '.join([*steps, slope, *totals, guard])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 24])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--run", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_one(args.run, args.depth, args.steps, args.count, args.out)
        return
    summary = json.loads(json.dumps(measure(args.depths, args.runs, args.steps)))  # depths as strings
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=1))
    print(markdown_table(summary))


if __name__ == "__main__":
    main()
