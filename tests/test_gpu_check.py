"""The GPU check's CPU rehearsal: the same steps as on the GPU machine, tiny, so the script itself is
tested before any GPU time is spent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = [
    "background.json",
    "check.log",
    "compiled-layers.json",
    "env.txt",
    "gpt2-profile.json",
    "gpu-tests.log",
    "plans.txt",
    "resnet50-profile.json",
    "summary.md",
]


def gpu_check(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out)}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args],
        capture_output=True,
        text=True,
        timeout=420,
        env=env,
    )


def test_rehearsal_runs_every_step_and_returns_only_its_own_nine_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = gpu_check(out, "--rehearse")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == FILES
    summary = (out / "summary.md").read_text()
    assert "# GPU check (CPU rehearsal)" in summary
    steps = [line for line in summary.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(steps) == 10 and all("| ok |" in line for line in steps), steps
    assert summary.count("predicted step time") == 2
    for name in ("resnet50", "gpt2"):
        profile = json.loads((out / f"{name}-profile.json").read_text())
        assert profile["device"].startswith("cpu") and profile["layers"]
    plans = (out / "plans.txt").read_text()
    assert plans.count("assumes collectives: 350 GB/s, 5 us") == 2  # one node on NVLink
    assert plans.count("assumes collectives: 45 GB/s, 15 us") == 2  # beyond it, InfiniBand
    background = json.loads((out / "background.json").read_text())
    assert (background["device"], background["steps"], list(background["plans"])) == ("cpu", 12, ["single"])
    assert list(json.loads((out / "compiled-layers.json").read_text())["step_time_ms"]) == [
        "eager",
        "compiled",
    ]


def test_a_folder_that_holds_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "old.json").write_text("{}")
    result = gpu_check(tmp_path, "--rehearse")
    assert result.returncode != 0
    assert "is not empty; give an empty folder" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["old.json"]
