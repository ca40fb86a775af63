"""The background-jobs example runs end to end under the popen launcher (as a subprocess: popen
children re-run their parent's command line, which must not be pytest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "background_jobs.py"


def test_example_smoke_run_trains_every_trial_on_the_idle_rank_of_two_popen_ranks(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEEPPOOL_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--smoke", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # The plan runs the head on rank 0 alone: rank 1 has the idle time, and every trial goes there.
    assert "rank 1 (idle" in result.stdout and "): lr0.3, lr0.1, lr0.03" in result.stdout
    assert "background jobs on rank 0" not in result.stdout
    assert "background jobs on rank 1 (mode idle)" in result.stdout
    for name in ("lr0.3", "lr0.1", "lr0.03"):
        checkpoint = torch.load(tmp_path / "trials" / f"{name}.ckpt", weights_only=False)
        assert checkpoint["global_step"] == 5, name
