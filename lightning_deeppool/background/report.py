"""What a rank reports about its jobs: per-step metrics for the logger and a table at the end of fit."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from lightning_deeppool.background.job import STATES, BackgroundJob


def job_metrics(jobs: Sequence[BackgroundJob], duty: float | None) -> dict[str, float]:
    """``background/<name>/{steps,samples_per_s,state,loss}`` per job, and ``background/duty``."""
    metrics: dict[str, float] = {}
    for job in jobs:
        prefix = f"background/{job.name}"
        metrics[f"{prefix}/steps"] = float(job.stats.global_step)
        metrics[f"{prefix}/samples_per_s"] = job.stats.samples_per_s
        metrics[f"{prefix}/state"] = float(STATES.index(job.stats.state))
        if job.stats.loss is not None:
            metrics[f"{prefix}/loss"] = job.stats.loss
    if duty is not None:
        metrics["background/duty"] = duty
    return metrics


def format_summary(
    rows: Sequence[dict[str, Any]],
    *,
    rank: int,
    mode: str | None,
    held_s: Sequence[float],
    active_s: Sequence[float],
    held_by_trade: int,
) -> str:
    """One line per job (state, steps, rate, loss), the foreground's median step without and with
    the jobs, the steps the trade check held them, and each failed job's traceback."""

    def median(xs: Sequence[float]) -> str:
        return f"{statistics.median(xs) * 1e3:.1f} ms" if xs else "-"

    lines = [
        f"background jobs on rank {rank} (mode {mode}):",
        f"{'job':<20} {'state':<8} {'steps':>7} {'samples/s':>10} {'loss':>10}",
    ]
    for row in rows:
        loss = f"{row['loss']:.4f}" if row["loss"] is not None else "-"
        lines.append(
            f"{row['name']:<20} {row['state']:<8} {row['global_step']:>7} "
            f"{row['samples_per_s']:>10.1f} {loss:>10}"
        )
    lines.append(
        f"foreground step: {median(held_s)} without background, "
        f"{median(active_s)} with ({len(held_s)} / {len(active_s)} steps)"
    )
    if held_by_trade:
        lines.append(
            f"jobs held {held_by_trade} steps: they gained less (in device-seconds) than the foreground lost"
        )
    for row in rows:
        if row["error"]:
            lines.append(f"{row['name']} failed:\n{row['error']}")
    return "\n".join(lines)
