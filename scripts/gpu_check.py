"""The GPU check as data: a list of steps, each a command with a time limit and the files it leaves.

    scripts/gpu_check.sh              # on a machine with CUDA: the figures, in under 9 minutes
    scripts/gpu_check.sh --rehearse   # the same steps on CPU with tiny sizes, in about a minute

Every file it writes goes to `--out`, which must be empty (only this run's results reach it), flat,
at most 9 files: `summary.md` (what ran, how long, the headline figures), `check.log` (every
step's output), `env.txt`, `gpu-tests.log`, `plans.txt` (plan tables and projections),
`resnet50-profile.json`, `gpt2-profile.json`, `background.json`, `compiled-layers.json`. A step
that fails or runs past its limit is recorded and the next one runs. Nothing is fetched: missing
pure-Python packages come from `.whl/` (`scripts/gpu_wheels.sh`), which `gpu_check.sh` installs first.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ("torch", "lightning", "jsonargparse", "transformers", "pytest", "yaml")
# Link figures for the projections: one node's NVLink (H200 SXM, NCCL bus bandwidth) and, beyond
# one node, one 400 Gb/s InfiniBand NIC per GPU; point-to-point transfers get the same figures.
NVLINK = ("350", "5")
INFINIBAND = ("45", "15")


@dataclass(frozen=True)
class Sizes:
    """What the check runs at: the full figures or the CPU rehearsal's tiny stand-ins."""

    resnet: dict[str, object]
    resnet_shape: str
    resnet_batch: int
    gpt: dict[str, object]
    gpt_tokens: int
    gpt_batch: int
    one_node: int
    cluster: tuple[int, ...]  # device counts beyond one node, each model's up to its global batch
    background: tuple[str, ...]
    limit_s: int  # per plan step
    budget_s: int  # the whole check: a step gets at most what is left
    compiled: tuple[str, ...]  # the compiled-layers benchmark's arguments
    profile: tuple[str, ...]  # untimed and timed runs per layer when planning


FULL = Sizes(
    resnet={},
    resnet_shape="3,224,224",
    resnet_batch=1024,
    gpt={},
    gpt_tokens=128,
    gpt_batch=512,
    one_node=8,
    cluster=(16, 32, 64, 128, 256, 512, 1024),
    background=(
        "--runs",
        "3",
        "--steps",
        "60",
        "--batch",
        "128",
        "--standalone-steps",
        "300",
        "--max-slowdown",
        "1.05",
    ),
    limit_s=150,
    budget_s=520,
    compiled=("--steps", "200", "--backend", "inductor"),
    profile=("--warmup", "1", "--repeats", "3"),
)
REHEARSAL = Sizes(
    resnet={"width": 4, "blocks": [1, 1, 1, 1], "classes": 10},
    resnet_shape="3,32,32",
    resnet_batch=16,
    gpt={"layers": 2, "hidden": 32, "heads": 2, "vocab": 128, "positions": 32},
    gpt_tokens=16,
    gpt_batch=16,
    one_node=4,
    cluster=(8, 16),
    background=("--runs", "1", "--steps", "12", "--batch", "4", "--standalone-steps", "20"),
    limit_s=120,
    budget_s=400,
    compiled=("--steps", "10", "--depth", "4", "--runs", "1", "--backend", "aot_eager"),
    profile=("--warmup", "0", "--repeats", "1"),
)


@dataclass(frozen=True)
class Step:
    name: str
    command: tuple[str, ...]
    timeout_s: int
    log: str | None = None  # a file of its own in the output folder, besides check.log


def steps(sizes: Sizes, out: Path, scratch: Path, device: str) -> list[Step]:
    """The check, in order: environment, the gpu-marked tests, plans and projections of two models,
    background jobs beside a one-device foreground, eager against compiled (and CUDA-graphed) layers."""
    python = sys.executable
    cli = (python, "-m", "lightning_deeppool.cli")
    profile = ("--device", device, *sizes.profile)
    plan = (*cli, "plan", "--amplification-limit", "2.0", *profile)
    models = {
        "resnet50": (
            "benchmarks/large.py:ResNet50",
            sizes.resnet,
            ("--input-shape", sizes.resnet_shape),
            sizes.resnet_batch,
        ),
        "gpt2": (
            "benchmarks/large.py:GPT2Small",
            sizes.gpt,
            ("--input-shape", str(sizes.gpt_tokens), "--input-dtype", "int64"),
            sizes.gpt_batch,
        ),
    }
    listed: list[Step] = [
        Step("environment", (python, str(ROOT / "scripts" / "gpu_check.py"), "--environment"), 60, "env.txt"),
        Step(
            "gpu tests",
            (python, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "tests"),
            240,
            "gpu-tests.log",
        ),
    ]
    for name, (path, init_args, inputs, batch) in models.items():
        profile_file = out / f"{name}-profile.json"
        cluster = tuple(n for n in sizes.cluster if n <= batch)
        options: dict[str, object] = {}
        if init_args:
            config = scratch / f"{name}.yaml"
            config.write_text(json.dumps(init_args))
            options["--config"] = config
        options |= {
            "--global-batch-size": batch,
            "--devices": max(cluster),
            "--bandwidth": INFINIBAND[0],
            "--latency-us": INFINIBAND[1],
            "--out": scratch / f"{name}-plan.json",
            "--profile-out": profile_file,
        }
        listed.append(
            Step(f"plan {name}", (*plan, path, *inputs, *flags(options)), sizes.limit_s, "plans.txt")
        )
        for devices, (bandwidth, latency) in ((sizes.one_node,), NVLINK), (cluster, INFINIBAND):
            options = {
                "--profile": profile_file,
                "--global-batch-size": batch,
                "--devices": ",".join(map(str, devices)),
                "--bandwidth": bandwidth,
                "--latency-us": latency,
            }
            listed.append(
                Step(
                    f"simulate {name} at {options['--devices']}",
                    (*cli, "simulate", *flags(options)),
                    60,
                    "plans.txt",
                )
            )
    background = {"--devices": 1, "--out": out / "background.json", "--workdir": scratch / "background"}
    listed.append(
        Step(
            "background jobs beside one device",
            (python, "benchmarks/background.py", *sizes.background, *flags(background)),
            sizes.limit_s + 60,
        )
    )
    compiled = {"--device": device, "--out": out / "compiled-layers.json"}
    listed.append(
        Step(
            "eager, compiled and CUDA-graphed layers on one device",
            (python, "benchmarks/compiled_layers.py", *sizes.compiled, *flags(compiled)),
            120,
        )
    )
    return listed


def flags(options: dict[str, object]) -> tuple[str, ...]:
    """``{"--devices": 8}`` -> ``("--devices", "8")``."""
    return tuple(str(part) for item in options.items() for part in item)


def run(step: Step, out: Path, left_s: float) -> tuple[str, float]:
    """Run one step in its own process group (a timeout stops its children too) for at most its
    limit or `left_s`; append its output to check.log and its own log. Returns status and duration."""
    limit = min(step.timeout_s, int(left_s))
    if limit < 10:
        return "skipped: the check's time budget is spent", 0.0
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as capture:
        process = subprocess.Popen(
            step.command, cwd=ROOT, stdout=capture, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=limit)
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = f"stopped at its {limit} s limit"
        capture.seek(0)
        text = capture.read()
    seconds = time.perf_counter() - start
    header = f"==== {step.name}: {status}, {seconds:.0f} s\n$ {' '.join(step.command)}\n"
    for name in {"check.log", step.log} - {None}:
        with open(out / str(name), "a") as log:
            log.write(header + text + "\n")
    print(header + "\n".join(text.splitlines()[-15:]), flush=True)
    return status, seconds


def headline(out: Path) -> list[str]:
    """The figures worth reading first, from the files the steps wrote."""
    lines = []
    tests = out / "gpu-tests.log"
    if tests.exists():
        tail = [
            line
            for line in tests.read_text().splitlines()
            if " passed" in line or " skipped" in line or " failed" in line
        ]
        lines += [f"- gpu tests: {tail[-1].strip('= ')}"] if tail else []
    plans = out / "plans.txt"
    if plans.exists():
        lines += [
            f"- {line.strip()}"
            for line in plans.read_text().splitlines()
            if line.startswith("predicted step time")
        ]
    background = out / "background.json"
    if background.exists():
        result = json.loads(background.read_text())
        for name, figures in result["plans"].items():
            slowdown, worst = figures["foreground_slowdown"], figures["foreground_slowdown_max"]
            lines.append(
                f"- background ({result['device']}, {name}): foreground slowdown {slowdown:.3f}x "
                f"(max {worst:.3f}x), total throughput "
                f"{figures['total_throughput_vs_foreground_alone']:.2f}x of the foreground alone "
                f"(min {figures['total_throughput_min']:.2f}x), medians of {result['runs']} alternating runs"
            )
    compiled = out / "compiled-layers.json"
    if compiled.exists():
        times = json.loads(compiled.read_text())["step_time_ms"]
        lines.append("- layers on one device: " + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()))
    return lines


def environment() -> None:
    """Print what this machine has: GPU, Python and the versions of what the check uses."""
    import torch

    print(f"python {sys.version.split()[0]} at {sys.executable}")
    for name in NEEDED:
        module = __import__(name)
        print(f"{name} {getattr(module, '__version__', '?')} ({Path(module.__file__ or '').parent})")
    if torch.cuda.is_available():
        print(
            f"cuda {torch.version.cuda}; device 0: {torch.cuda.get_device_name(0)}, "
            f"{torch.cuda.device_count()} device(s)"
        )
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"],
            capture_output=True,
            text=True,
        )
        print(smi.stdout or smi.stderr)
    else:
        print("no CUDA device: CPU only")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-results"))
    parser.add_argument("--rehearse", action="store_true", help="the same steps on CPU, tiny and fast")
    parser.add_argument("--environment", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.environment:
        environment()
        return
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(
            f"gpu check: {', '.join(missing)} cannot be imported here, and nothing is fetched. On a machine "
            "with network, run scripts/gpu_wheels.sh (it fills .whl/), carry .whl along, and run "
            "scripts/gpu_check.sh, which installs them first."
        )
    import torch

    if not args.rehearse and not torch.cuda.is_available():
        sys.exit("gpu check: no CUDA device here; use --rehearse to run the same steps on CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    if any(args.out.iterdir()):
        sys.exit(
            f"gpu check: {args.out} is not empty; give an empty folder so only this run's results are in it"
        )
    sizes = REHEARSAL if args.rehearse else FULL
    device = "cpu" if args.rehearse else "cuda"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="deeppool-gpu-check-") as scratch:
        results = []
        for step in steps(sizes, args.out, Path(scratch), device):
            left = sizes.budget_s - (time.perf_counter() - started)
            results.append((step, *run(step, args.out, left)))
    kind = "CPU rehearsal" if args.rehearse else "GPU"
    lines = [
        f"# GPU check ({kind}), {time.perf_counter() - started:.0f} s in all",
        "",
        *headline(args.out),
        "",
        "| step | status | seconds |",
        "| --- | --- | ---: |",
        *(f"| {step.name} | {status} | {seconds:.0f} |" for step, status, seconds in results),
    ]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(0 if all(status == "ok" for _, status, _ in results) else 1)


if __name__ == "__main__":
    main()
